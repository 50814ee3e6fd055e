"""Each engine is priced in one place: a strategy names its engine's cost model (`cost`), the
planner asks that model, and no strategy class nor the contract it is built on answers a
pricing question itself. Pure Python, no worker is started."""
from lowcomm.contract.base import Strategy
from lowcomm.contract.plan import Cost
from lowcomm.engines.costs import BucketedAllReduce
from lowcomm.engines.costs_sharded import AccoCost, DpuCost, OverlappedCost
from lowcomm.engines.outer_contract import OuterSyncCost
from lowcomm.strategies import available, get

PRICING = {name for name in vars(Cost) if not name.startswith("__")}


def test_no_strategy_class_or_contract_base_defines_a_pricing_member():
    """What the planner asks (exposed seconds, occurrences, level plans, memory, label...) is
    the cost model's: a strategy that priced itself beside its model would be priced twice."""
    assert {"exposed_comm_s", "plan_occurrences", "level_plans", "model_state_bytes"} <= PRICING
    for name in available():
        for klass in get(name).__mro__:
            if klass is not object:
                assert not PRICING & set(vars(klass)), f"{name}: {klass.__qualname__} defines " \
                                                       f"{sorted(PRICING & set(vars(klass)))}"
    assert Strategy.cost is Cost  # the default: collectives after the compute


def test_each_strategy_names_the_cost_model_of_its_engine():
    expected = {"ddp": BucketedAllReduce, "acco": AccoCost, "dpu": DpuCost, "diloco": OuterSyncCost,
                "streaming_diloco": OuterSyncCost, "sparseloco": OuterSyncCost}
    for name in available():
        cost = get(name).cost
        assert isinstance(cost, type) and issubclass(cost, Cost), name
        if name in expected:
            assert cost is expected[name], name
    overlapped = {name for name in available() if issubclass(get(name).cost, OverlappedCost)}
    assert overlapped == {"acco", "dpu"}
    assert {name for name in available() if get(name).cost.comm_overlap > 0} == overlapped
