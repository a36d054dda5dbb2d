#!/bin/sh
# Waits until the Redis of $KVSERVE_REDIS_URL can take the kvmanager's writes (the kvmanager's init container
# `wait-for-redis` runs it; the kvmanager loads its state at start and exits if it cannot). For a
# redis+sentinel://H:P[,H:P...]/NAME[/DB] URL: a Sentinel names the primary, that primary answers as one, and at
# least $KVSERVE_REDIS_WAIT_REPLICAS replicas (default 1) are connected to it, or the WAIT after the first
# writes would time out. For any other URL (a managed Redis): it answers PING.

# 0 when the primary that one of the Sentinels names is ready.
sentinel_primary_ready() {
  rest=${KVSERVE_REDIS_URL#redis+sentinel://}
  name=${rest#*/}
  name=${name%%/*}
  for sentinel in $(echo "${rest%%/*}" | tr ',' ' '); do
    addr=$(timeout 3 redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" --raw \
      SENTINEL get-master-addr-by-name "$name" 2>/dev/null | tr -d '\r' | tr '\n' ' ')
    set -- $addr
    [ $# -eq 2 ] || continue
    info=$(timeout 3 redis-cli -h "$1" -p "$2" INFO replication 2>/dev/null | tr -d '\r')
    echo "$info" | grep -qx "role:master" || continue
    replicas=$(echo "$info" | sed -n 's/^connected_slaves://p')
    [ "${replicas:-0}" -ge "${KVSERVE_REDIS_WAIT_REPLICAS:-1}" ] && return 0
  done
  return 1
}

ready() {
  case "$KVSERVE_REDIS_URL" in
    redis+sentinel://*) sentinel_primary_ready ;;
    *) timeout 3 redis-cli -u "$KVSERVE_REDIS_URL" PING 2>/dev/null | grep -q PONG ;;
  esac
}

until ready; do
  echo "waiting for Redis ($KVSERVE_REDIS_URL)"
  sleep 2
done
