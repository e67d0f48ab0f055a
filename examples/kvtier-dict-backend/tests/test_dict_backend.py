"""kvtier's conformance suite, run against the plugin as kvtier would build it from a config."""

from kvtier import registry
from kvtier.testing import BackendTests


class TestDictBackend(BackendTests):
    def make_backend(self, path, capacity):
        return registry.backends.get("demo-dict")(capacity=capacity, label="test")


def test_fifo_policy_evicts_in_insertion_order():
    policy = registry.policies.get("demo-fifo")()
    for key in (b"a", b"b", b"c"):
        policy.insert(key)
    policy.touch(b"a")
    assert policy.evict(2, protected={b"a"}) == [b"b", b"c"]
    assert policy.evict(2) is None and policy.order() == [b"a"]
