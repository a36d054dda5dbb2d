#!/bin/sh
# Chooses this Redis pod's role and writes its redis.conf and sentinel.conf into $DATA_DIR from the templates
# in $CONFIG_DIR (the init container `config` of redis-statefulset.yaml runs it before Redis and Sentinel
# start). The primary is, in this order:
#   1. the one a running Sentinel names (SENTINEL get-master-addr-by-name): the set is up and may have failed
#      over since this pod last ran, so even the pod of ordinal 0 comes back as a replica;
#   2. the one this pod's own Sentinel last knew (the `monitor` line it rewrote into $DATA_DIR/sentinel.conf):
#      the whole set starts again (a cluster restart) and no Sentinel runs yet;
#   3. $PRIMARY_AT_START, the pod of ordinal 0: the very first start.
# Environment: POD_HOST (this pod's DNS name), PRIMARY_AT_START, SENTINELS (host:port,...), MASTER_NAME,
# REDIS_PORT, SENTINEL_PORT, CONFIG_DIR, DATA_DIR.
set -eu

# "host port" of the primary as the first Sentinel that answers names it, or nothing.
ask_sentinels() {
  for sentinel in $(echo "$SENTINELS" | tr ',' ' '); do
    addr=$(timeout 3 redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" --raw \
      SENTINEL get-master-addr-by-name "$MASTER_NAME" 2>/dev/null | tr -d '\r' | tr '\n' ' ') || true
    set -- $addr
    # Two words, host and port; nothing (no answer, an unknown name) or an error reply is something else.
    if [ $# -eq 2 ] && [ "$2" -eq "$2" ] 2>/dev/null; then
      echo "$1 $2"
      return 0
    fi
  done
}

# A field of this pod's last sentinel.conf: `saved monitor` = "host port" of the primary, `saved myid` = its id.
saved() {
  [ -f "$DATA_DIR/sentinel.conf" ] || return 0
  awk -v what="$1" -v name="$MASTER_NAME" '
    $1 == "sentinel" && $2 == "monitor" && $3 == name && what == "monitor" { print $4, $5 }
    $1 == "sentinel" && $2 == "myid" && what == "myid" { print $3 }' "$DATA_DIR/sentinel.conf"
}

# render HOST PORT FILE: the template FILE -> $DATA_DIR/FILE.new, the primary at HOST:PORT.
render() {
  sed -e "s|@POD_HOST@|$POD_HOST|g" -e "s|@PRIMARY@|$1|g" -e "s|@PRIMARY_PORT@|$2|g" \
    -e "s|@MASTER_NAME@|$MASTER_NAME|g" -e "s|@REDIS_PORT@|$REDIS_PORT|g" -e "s|@SENTINEL_PORT@|$SENTINEL_PORT|g" \
    -e "s|@DATA_DIR@|$DATA_DIR|g" "$CONFIG_DIR/$3" > "$DATA_DIR/$3.new"
}

primary=$(ask_sentinels)
[ -n "$primary" ] || primary=$(saved monitor)
[ -n "$primary" ] || primary="$PRIMARY_AT_START $REDIS_PORT"
myid=$(saved myid)
set -- $primary

render "$1" "$2" redis.conf
if [ "$1" != "$POD_HOST" ]; then
  echo "replicaof $1 $2" >> "$DATA_DIR/redis.conf.new"
fi
render "$1" "$2" sentinel.conf
# The same id as before, so that the other Sentinels see this one come back rather than a second one.
if [ -n "$myid" ]; then
  echo "sentinel myid $myid" >> "$DATA_DIR/sentinel.conf.new"
fi
# Each file whole or not at all: a pod stopped here starts again from the old ones.
mv "$DATA_DIR/redis.conf.new" "$DATA_DIR/redis.conf"
mv "$DATA_DIR/sentinel.conf.new" "$DATA_DIR/sentinel.conf"
echo "$POD_HOST: primary $1:$2"
