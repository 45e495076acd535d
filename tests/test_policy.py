"""The reuse policy: strict settings, the estimate, the choice, and its properties.

Property tests name the invariants they check: INV-POLICY-DISABLED, INV-POLICY-GPU-GATED,
INV-POLICY-MINIMUMS and INV-POLICY-MONOTONE. The last test plants a bug in the chooser
and asserts the same property check fails on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from support.errors import raises
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvstate.reuse import policy, profile
from kvstate.core.errors import KvStateError, ConfigInvalid, ArgumentInvalid
from kvstate.core.reasons import DecisionReason, ConfigReason, ArgumentReason
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.reuse.policy import Candidate, DecisionReason, ReuseSettings, choose_transfer_source, estimate_ttft_saving
from kvstate.core.capabilities import Capabilities, MemoryKind, Scope

# -- settings ------------------------------------------------------------------------


def test_exactly_the_eight_settings_and_reuse_off_by_default() -> None:
    assert policy.SETTING_NAMES == (
        "enable_decode_to_prefill_reuse",
        "enable_decode_to_prefill_gpu_reuse",
        "minimum_estimated_ttft_saving_ms",
        "minimum_transfer_prefix_blocks",
        "transfer_source_estimated_block_us",
        "transfer_source_gpu_estimated_block_us",
        "transfer_source_lookup_budget_ms",
        "transfer_source_prefill_token_us",
    )
    s = ReuseSettings()
    assert s.enable_decode_to_prefill_reuse is False and s.enable_decode_to_prefill_gpu_reuse is False


def test_every_default_is_documented() -> None:
    doc = ReuseSettings.__doc__ or ""
    page = (Path(__file__).parents[1] / "docs" / "policy.md").read_text(encoding="utf-8")
    for name in policy.SETTING_NAMES:
        default = getattr(ReuseSettings(), name)
        assert f"{name} = {default}" in doc, name
        assert f"`{name}`" in page and f"`{default}`".lower() in page.lower(), name


def test_cost_defaults_follow_from_the_cited_figures() -> None:
    """The arithmetic behind the defaults (docs/policy.md), on kvstate's own Geometry."""
    block = Geometry.uniform(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype=DType.BF16,
                     layout=Layout.BLOCK_MAJOR, num_blocks=1).block_bytes  # Llama-3-8B, vLLM block size
    assert block == 2 * 2**20
    d = ReuseSettings()
    pcie4_x16, h100_nvlink, h100_bf16, llama3_8b_params = 31.5e9, 450e9, 989e12, 8.03e9
    assert d.transfer_source_estimated_block_us == 5 * math.ceil(block / (0.5 * pcie4_x16) * 1e6 / 5)
    assert d.transfer_source_gpu_estimated_block_us == math.ceil(block / (0.5 * h100_nvlink) * 1e6)
    assert d.transfer_source_prefill_token_us == math.floor(2 * llama3_8b_params / h100_bf16 * 1e6)
    assert d.transfer_source_lookup_budget_ms == d.minimum_estimated_ttft_saving_ms / 5


def test_mapping_env_and_cli_load_strictly() -> None:
    s = ReuseSettings.load(
        mapping={"enable_decode_to_prefill_reuse": True, "minimum_transfer_prefix_blocks": 2},
        environ={"KVSTATE_POLICY_MINIMUM_ESTIMATED_TTFT_SAVING_MS": "5.5", "PATH": "/bin",
                 "KVSTATE_OTHER_THING": "ignored: not a policy variable"},
        argv=["--transfer-source-lookup-budget-ms", "1", "--enable-decode-to-prefill-gpu-reuse=1"],
    )
    assert s.enable_decode_to_prefill_reuse and s.enable_decode_to_prefill_gpu_reuse
    assert s.minimum_transfer_prefix_blocks == 2
    assert s.minimum_estimated_ttft_saving_ms == 5.5
    assert s.transfer_source_lookup_budget_ms == 1.0
    # later sources win
    assert ReuseSettings.load({"minimum_transfer_prefix_blocks": 2}, {"KVSTATE_POLICY_MINIMUM_TRANSFER_PREFIX_BLOCKS": "3"},
                              ["--minimum-transfer-prefix-blocks", "5"]).minimum_transfer_prefix_blocks == 5


@pytest.mark.parametrize("load, named", [
    (lambda: ReuseSettings.from_mapping({"minimum_ttft_saving_ms": 1}), "minimum_ttft_saving_ms"),
    (lambda: ReuseSettings.from_env({"KVSTATE_POLICY_ENABLE_REUSE": "true"}), "KVSTATE_POLICY_ENABLE_REUSE"),
    (lambda: ReuseSettings.from_cli(["--enable-reuse", "true"]), "--enable-reuse"),
    (lambda: ReuseSettings.from_cli(["--enable_decode_to_prefill_reuse=true"]), "--enable_decode_to_prefill_reuse"),
])
def test_unknown_setting_is_named(load: Callable[[], object], named: str) -> None:
    with raises(ConfigInvalid, ConfigReason.UNKNOWN_SETTING) as info:
        load()
    assert info.value.name == named and named in str(info.value)


@pytest.mark.parametrize("name, value", [
    ("minimum_estimated_ttft_saving_ms", -1.0),
    ("minimum_estimated_ttft_saving_ms", math.nan),
    ("transfer_source_prefill_token_us", math.inf),
    ("transfer_source_estimated_block_us", "-0.5"),
    ("transfer_source_gpu_estimated_block_us", "nan"),
    ("transfer_source_lookup_budget_ms", "inf"),
    ("transfer_source_lookup_budget_ms", "two"),
    ("minimum_transfer_prefix_blocks", -1),
    ("minimum_transfer_prefix_blocks", 1.5),
    ("minimum_transfer_prefix_blocks", "4.0"),
    ("minimum_transfer_prefix_blocks", True),
    ("enable_decode_to_prefill_reuse", "yes"),
    ("enable_decode_to_prefill_reuse", "TRUE!"),
    ("enable_decode_to_prefill_reuse", 1),
    ("enable_decode_to_prefill_gpu_reuse", ""),
])
def test_bad_values_are_typed_errors(name: str, value: object) -> None:
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING) as info:
        ReuseSettings.from_mapping({name: value})
    assert info.value.name == name


@pytest.mark.parametrize("text, expected", [("true", True), ("false", False), ("1", True), ("0", False),
                                            ("True", True), ("FALSE", False)])
def test_booleans_parse_from_exactly_true_false_1_0(text: str, expected: bool) -> None:
    assert ReuseSettings.from_env({"KVSTATE_POLICY_ENABLE_DECODE_TO_PREFILL_REUSE": text}
                                  ).enable_decode_to_prefill_reuse is expected


def test_cli_refuses_missing_value_and_repeats() -> None:
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):
        ReuseSettings.from_cli(["--minimum-transfer-prefix-blocks"])
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):
        ReuseSettings.from_cli(["--minimum-transfer-prefix-blocks", "1", "--minimum-transfer-prefix-blocks=2"])
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):
        ReuseSettings.from_cli(["stray"])


def test_direct_construction_is_validated_too() -> None:
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):
        ReuseSettings(minimum_estimated_ttft_saving_ms=-0.1)
    with raises(ConfigInvalid, ConfigReason.INVALID_SETTING):
        ReuseSettings(enable_decode_to_prefill_reuse=1)  # type: ignore[arg-type]


# -- the estimate --------------------------------------------------------------------


ON = ReuseSettings(enable_decode_to_prefill_reuse=True)


def test_estimate_terms_follow_the_formula() -> None:
    t = estimate_ttft_saving(100, block_tokens=16, memory=MemoryKind.HOST, settings=ON)
    assert t.tokens_avoided == 1600
    assert t.prefill_ms == pytest.approx(1600 * 16.0 / 1000)
    assert t.transfer_ms == pytest.approx(100 * 135.0 / 1000)
    assert t.lookup_ms == 2.0
    assert t.saving_ms == pytest.approx(t.prefill_ms - t.transfer_ms - t.lookup_ms)
    g = estimate_ttft_saving(100, block_tokens=16, memory=MemoryKind.DEVICE, settings=ON)
    assert g.transfer_ms == pytest.approx(100 * 10.0 / 1000) and g.saving_ms > t.saving_ms


def test_a_transfer_dearer_than_recompute_saves_nothing() -> None:
    dear = attrs.evolve(ON, transfer_source_estimated_block_us=1000.0)
    t = estimate_ttft_saving(50, block_tokens=16, memory=MemoryKind.HOST, settings=dear)
    assert t.saving_ms == -dear.transfer_source_lookup_budget_ms


def amounts(top: int) -> st.SearchStrategy[float]:
    """Round figures like the ones operators set, and arbitrary floats."""
    return st.one_of(st.integers(0, top).map(float), st.floats(0, top))


settings_st = st.builds(
    ReuseSettings,
    enable_decode_to_prefill_reuse=st.booleans(),
    enable_decode_to_prefill_gpu_reuse=st.booleans(),
    minimum_estimated_ttft_saving_ms=st.one_of(st.just(0.0), amounts(50)),
    minimum_transfer_prefix_blocks=st.integers(0, 64),
    transfer_source_estimated_block_us=amounts(2000),
    transfer_source_gpu_estimated_block_us=amounts(2000),
    transfer_source_lookup_budget_ms=st.one_of(st.just(0.0), amounts(3)),
    transfer_source_prefill_token_us=amounts(100),
)


@given(settings_st, st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 256),
       st.sampled_from(list(MemoryKind)))
def test_saving_is_monotone_in_saved_blocks(s: ReuseSettings, n: int, more: int, block_tokens: int,
                                            memory: MemoryKind) -> None:
    """INV-POLICY-MONOTONE, on the public estimate."""
    few = estimate_ttft_saving(n, block_tokens=block_tokens, memory=memory, settings=s)
    many = estimate_ttft_saving(n + more, block_tokens=block_tokens, memory=memory, settings=s)
    assert many.saving_ms >= few.saving_ms


# -- the choice ----------------------------------------------------------------------


def _caps(profile_name: str) -> profile.PublishedCapabilities:
    host = profile.TransportCapabilities("host", Capabilities(frozenset({HandleKind.MEMFD}),
                                                              frozenset({MemoryKind.HOST}), frozenset({Scope.SAME_NODE})))
    cuda = profile.TransportCapabilities("cuda", Capabilities(frozenset({HandleKind.POSIX_FD}),
                                                              frozenset({MemoryKind.DEVICE}), frozenset({Scope.SAME_NODE})))
    transports = (host,) if profile_name == "host" else (host, cuda)
    kinds = frozenset(k for t in transports for k in t.capabilities.handle_kinds)
    return profile.PublishedCapabilities(device_uuids=(bytes(range(16)),), handle_kinds=kinds,
                                         fabric_trial=profile.FabricTrial.NOT_RUN, transports=transports,
                                         geometry_fingerprint=b"\x01" * 16, protocol_version=profile.PROTOCOL_VERSION)


GPU_ADMITTED = profile.admit(profile.DeploymentProfile.GPU_SINGLE_NODE, _caps("gpu"))
HOST_ADMITTED = profile.admit(profile.DeploymentProfile.HOST_LOCAL, _caps("host"))
assert isinstance(GPU_ADMITTED, profile.Admitted) and GPU_ADMITTED.gpu_reuse_allowed
assert isinstance(HOST_ADMITTED, profile.Admitted) and not HOST_ADMITTED.gpu_reuse_allowed

@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[Candidate]]:
    """A target prefix and candidates near it, so that every gate is often the deciding one."""
    target = draw(st.integers(0, 200))
    near = st.integers(max(0, target - 4), target + 80)
    cands = draw(st.lists(st.builds(Candidate, source_id=st.sampled_from(["d0", "d1", "d2", "d3"]),
                                    prefix_blocks=near, memory=st.sampled_from(list(MemoryKind))), max_size=6))
    return target, cands


admitted_st = st.sampled_from([None, GPU_ADMITTED, HOST_ADMITTED])


def _frozen_clock() -> Callable[[], float]:
    return lambda: 0.0


def check_policy_properties(choose: Callable[..., policy.Decision], s: ReuseSettings, target: int,
                            cands: list[Candidate], block_tokens: int, admitted: Any) -> None:
    d = choose(target, cands, s, block_tokens=block_tokens, admitted=admitted, clock=_frozen_clock())
    gpu_ok = s.enable_decode_to_prefill_gpu_reuse and admitted is not None and admitted.gpu_reuse_allowed
    eligible = [c for c in cands if c.prefix_blocks > target and (gpu_ok or not c.gpu)]
    if d.recommended:
        assert s.enable_decode_to_prefill_reuse  # INV-POLICY-DISABLED
        assert d.source is not None and d.terms is not None
        assert not d.source.gpu or gpu_ok  # INV-POLICY-GPU-GATED
        assert d.terms.saved_blocks >= s.minimum_transfer_prefix_blocks  # INV-POLICY-MINIMUMS
        assert d.terms.saving_ms >= s.minimum_estimated_ttft_saving_ms  # INV-POLICY-MINIMUMS
    if not s.enable_decode_to_prefill_reuse:
        assert d.reason is DecisionReason.REUSE_DISABLED
        return
    if not eligible:
        assert d.reason is DecisionReason.NO_ELIGIBLE_SOURCE and d.source is None
        return
    assert d.source is not None and d.terms is not None
    assert d.source.prefix_blocks == max(c.prefix_blocks for c in eligible)  # the longest prefix wins
    assert d.terms.saved_blocks == d.source.prefix_blocks - target
    assert d.considered == len(cands)
    passes = (d.terms.saved_blocks >= s.minimum_transfer_prefix_blocks
              and d.terms.saving_ms >= s.minimum_estimated_ttft_saving_ms)
    assert d.recommended == passes  # the gates are the only reason left to refuse


@given(settings_st, scenarios(), st.integers(1, 64), admitted_st)
def test_choice_properties(s: ReuseSettings, scenario: tuple[int, list[Candidate]], block_tokens: int,
                           admitted: Any) -> None:
    check_policy_properties(choose_transfer_source, s, *scenario, block_tokens, admitted)


def test_property_check_catches_a_planted_chooser_bug() -> None:
    """Self-test: the same property check must fail on a chooser that skips a gate."""
    from planted import policy_bugs

    @settings(max_examples=5000, derandomize=True, database=None, phases=[Phase.generate])
    @given(settings_st, scenarios(), st.integers(1, 64), admitted_st)
    def prop(s: ReuseSettings, scenario: tuple[int, list[Candidate]], block_tokens: int, admitted: Any) -> None:
        check_policy_properties(policy_bugs.choose_transfer_source, s, *scenario, block_tokens, admitted)

    with pytest.raises(AssertionError):
        prop()


def test_gpu_needs_enabled_and_admitted_profile() -> None:
    cands = [Candidate("gpu", 500, MemoryKind.DEVICE), Candidate("host", 300, MemoryKind.HOST)]
    both = attrs.evolve(ON, enable_decode_to_prefill_gpu_reuse=True)
    d = choose_transfer_source(0, cands, both, block_tokens=16, admitted=GPU_ADMITTED, clock=_frozen_clock())
    assert d.recommended and d.source is not None and d.source.source_id == "gpu"
    for settings, admitted, why in [(ON, GPU_ADMITTED, DecisionReason.GPU_REUSE_DISABLED),
                                    (both, None, DecisionReason.GPU_PROFILE_NOT_ADMITTED),
                                    (both, HOST_ADMITTED, DecisionReason.GPU_PROFILE_NOT_ADMITTED)]:
        d = choose_transfer_source(0, cands, settings, block_tokens=16, admitted=admitted, clock=_frozen_clock())
        assert d.source is not None and d.source.source_id == "host"
        assert d.skipped == ((cands[0], why),)


def test_disabled_policy_reads_no_candidate() -> None:
    def never() -> Iterator[Candidate]:
        raise AssertionError("the lookup ran although reuse is disabled")
        yield  # pragma: no cover

    d = choose_transfer_source(0, never(), ReuseSettings(), block_tokens=16)
    assert d.reason is DecisionReason.REUSE_DISABLED and not d.recommended


def test_lookup_stops_within_its_budget() -> None:
    now = [0.0]
    pulled: list[int] = []

    def clock() -> float:
        return now[0]

    def lookups() -> Iterator[Candidate]:
        for i in range(10):
            pulled.append(i)
            now[0] += 0.0008  # each lookup takes 0.8 ms of a 2 ms budget
            yield Candidate(f"d{i}", 100 + i, MemoryKind.HOST)

    d = choose_transfer_source(0, lookups(), ON, block_tokens=16, clock=clock)
    # lookups 0 and 1 end at 0.8 and 1.6 ms; lookup 2 ends at 2.4 ms, late, and is not used;
    # no fourth lookup starts.
    assert pulled == [0, 1, 2]
    assert d.considered == 2 and d.lookup_exhausted
    assert d.source is not None and d.source.source_id == "d1"


def test_rejections_say_why() -> None:
    few = choose_transfer_source(10, [Candidate("d", 12, MemoryKind.HOST)], ON, block_tokens=16)
    assert few.reason is DecisionReason.BELOW_MINIMUM_BLOCKS and not few.recommended
    small = choose_transfer_source(0, [Candidate("d", 20, MemoryKind.HOST)], ON, block_tokens=16)
    assert small.reason is DecisionReason.BELOW_MINIMUM_SAVING
    none = choose_transfer_source(50, [Candidate("d", 20, MemoryKind.HOST)], ON, block_tokens=16)
    assert none.reason is DecisionReason.NO_ELIGIBLE_SOURCE and none.skipped[0][1] is DecisionReason.NO_LONGER_PREFIX
    for d in (few, small, none):
        assert d.reason.value in d.explain()


def test_both_minimums_are_inclusive_and_an_equal_prefix_saves_nothing() -> None:
    """INV-POLICY-MINIMUMS at its boundaries: exactly the minimum of blocks and exactly the
    minimum saving are enough, one block or one ulp less is not; a source that holds no
    more than the prefix already computed is not a candidate at all."""
    def pick(target: int, prefix: int, settings: ReuseSettings) -> policy.Decision:
        return choose_transfer_source(target, [Candidate("d", prefix, MemoryKind.HOST)], settings,
                                      block_tokens=16, clock=_frozen_clock())

    # 20 blocks save more than the 2 ms lookup budget costs, so only the minimum decides
    blocks = attrs.evolve(ON, minimum_transfer_prefix_blocks=20, minimum_estimated_ttft_saving_ms=0.0)
    assert pick(10, 30, blocks).reason is DecisionReason.CHOSEN
    assert pick(10, 29, blocks).reason is DecisionReason.BELOW_MINIMUM_BLOCKS
    saving = estimate_ttft_saving(30, block_tokens=16, memory=MemoryKind.HOST, settings=ON).saving_ms
    assert saving > 0
    exact = attrs.evolve(ON, minimum_transfer_prefix_blocks=0, minimum_estimated_ttft_saving_ms=saving)
    assert pick(10, 40, exact).reason is DecisionReason.CHOSEN
    above = attrs.evolve(exact, minimum_estimated_ttft_saving_ms=math.nextafter(saving, math.inf))
    assert pick(10, 40, above).reason is DecisionReason.BELOW_MINIMUM_SAVING
    anything = attrs.evolve(ON, minimum_transfer_prefix_blocks=0, minimum_estimated_ttft_saving_ms=0.0)
    equal = pick(10, 10, anything)
    assert equal.reason is DecisionReason.NO_ELIGIBLE_SOURCE
    assert equal.skipped[0][1] is DecisionReason.NO_LONGER_PREFIX


@pytest.mark.parametrize("bad", [
    lambda: Candidate("", 1, MemoryKind.HOST),
    lambda: Candidate("d", -1, MemoryKind.HOST),
    lambda: Candidate("d", True, MemoryKind.HOST),
    lambda: Candidate("d", 1, "host"),
    lambda: choose_transfer_source(-1, [], ON, block_tokens=16),
    lambda: choose_transfer_source(0, [], ON, block_tokens=0),
    lambda: choose_transfer_source(0, ["d0"], ON, block_tokens=16),
])
def test_bad_policy_input_is_a_typed_error(bad: Callable[[], object]) -> None:
    with raises(ArgumentInvalid, ArgumentReason.POLICY_INPUT):
        bad()


def test_errors_are_kvstate_errors() -> None:
    assert issubclass(ArgumentInvalid, KvStateError) and issubclass(ConfigInvalid, KvStateError)
