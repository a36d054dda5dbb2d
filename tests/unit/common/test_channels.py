"""kvmanager_channel's targets (kvserve/common/channels.py): one entry as given, a list as one address list that gRPC's
health-checked round robin balances over."""

from __future__ import annotations

import pytest

from kvserve.common.channels import kvmanager_target


def test_one_entry_is_the_target_as_given():
    assert kvmanager_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert kvmanager_target(" dns:///kvmanager-headless:50051 ") == "dns:///kvmanager-headless:50051"


def test_a_list_is_one_address_list_of_resolved_ips():
    assert kvmanager_target("127.0.0.1:1,localhost:2, 127.0.0.2:3") == "ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.2:3"
    assert kvmanager_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"


@pytest.mark.parametrize("spec,message", [
    (" , ", "no host:port"),
    ("127.0.0.1:1,127.0.0.1", "is not host:port"),
    ("127.0.0.1:1,dns:///name:2", "is not host:port"),
    ("127.0.0.1:1,no-such-host.invalid:2", "cannot resolve"),
    ("127.0.0.1:1,[::1]:2", "IPv4 and IPv6"),
])
def test_bad_lists_are_refused_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message):
        kvmanager_target(spec)
