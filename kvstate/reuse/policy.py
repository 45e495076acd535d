"""The reuse policy: whether to load a prefix from a decode worker, and from which one.

Theory of operation
-------------------

A prefill worker about to compute a prompt already holds ``target_prefix_blocks`` of it
in its own prefix cache. Some decode workers (the *candidates*) advertise, through their
retained inventory, that they still hold a longer prefix of the same prompt. Loading the
extra blocks from one of them saves prefill compute, but the load itself costs time:

    saved_blocks   = candidate.prefix_blocks - target_prefix_blocks
    tokens_avoided = saved_blocks * block_tokens
    per_block_net  = block_tokens * transfer_source_prefill_token_us
                     - (transfer_source_gpu_estimated_block_us  if the source is on a GPU
                        transfer_source_estimated_block_us      if it is in host memory)
    saving_ms      = max(0, saved_blocks * per_block_net) / 1000 - lookup_ms

A transfer that costs more per block than recomputing the block saves nothing; the gain is
clamped at zero, which also keeps the estimate monotone in the saved blocks (loading fewer
blocks is always an option). The lookup is charged at its budget,
``transfer_source_lookup_budget_ms``: the most it may take. That keeps the decision
independent of timing noise and never overstates the saving.

:func:`choose_transfer_source` reads candidates until the lookup budget is spent, skips
ineligible ones (no longer prefix; a GPU-resident source while GPU reuse is off or no
GPU-capable deployment profile is admitted), picks the eligible source with the longest
prefix beyond the target's own (ties: larger saving, then lookup order) and applies both
minimums as gates. The :class:`Decision` says why: chosen, or rejected with a reason, with
every term of the estimate.

The gates live in one pure function, :func:`gate`, and the estimate in another,
:func:`estimated_saving_ms`. Both have simple argument types and PEP 316 contracts that
crosshair checks (``tests/test_policy_contracts.py``): the policy never recommends when
disabled (INV-POLICY-DISABLED), never recommends a GPU source without GPU reuse enabled
and admitted (INV-POLICY-GPU-GATED), never recommends below either minimum
(INV-POLICY-MINIMUMS), and the saving does not decrease as saved blocks grow
(INV-POLICY-MONOTONE).

Settings
--------

:class:`ReuseSettings` holds exactly the eight settings below; reuse is off by default.
They load strictly from a mapping, from ``KVSTATE_POLICY_<NAME>`` environment variables and
from ``--<name-with-dashes>`` command-line flags (:meth:`ReuseSettings.load` applies them
in that order over the defaults). ``docs/policy.md`` explains each default.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvstate.core.errors import ConfigInvalid, ArgumentInvalid
from kvstate.core.reasons import ArgumentReason, ConfigReason
from kvstate.core.reasons import DecisionReason as DecisionReason  # its home is core.reasons; re-exported
from kvstate.reuse.profile import Admitted
from kvstate.core.capabilities import MemoryKind

ENV_PREFIX = "KVSTATE_POLICY_"

#: Upper bounds on counts, so arithmetic stays in float range. No KV cache is this large.
MAX_BLOCKS = 2**40
MAX_BLOCK_TOKENS = 2**20
#: Longest setting value accepted as text (a number or boolean needs far fewer).
MAX_SETTING_TEXT = 64


# -- settings ------------------------------------------------------------------------


def _check_bool(inst: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must be a boolean")


def _check_count(inst: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must be an integer")
    if value < 0:
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must not be negative")
    if value > MAX_BLOCKS:
        raise ConfigInvalid.invalid_setting(attribute.name, value, f"must be at most {MAX_BLOCKS}")


def _check_amount(inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must be a number")
    if not math.isfinite(value):
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must be finite")
    if value < 0:
        raise ConfigInvalid.invalid_setting(attribute.name, value, "must not be negative")


def _to_float(value: object) -> object:
    # ints are accepted for amounts and stored as floats; anything else reaches the validator.
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@attrs.frozen(kw_only=True)
class ReuseSettings:
    """The eight settings of decode-to-prefill reuse. Reuse is off by default.

    Defaults and why (``docs/policy.md`` has the arithmetic). The cost defaults describe
    one reference point, Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16; from its
    published ``config.json``) at vLLM's default block size of 16 tokens, so one block of
    K and V is 32*8*128*2*2*16 B = 2 MiB. They lean towards *not* reusing: transfer costs
    assume half the peak link bandwidth, prefill assumes the full peak compute. Measure
    your own deployment with ``benchmarks/`` and set them.

    enable_decode_to_prefill_reuse = False
        Reuse changes where KV comes from; a deployment opts in.
    enable_decode_to_prefill_gpu_reuse = False
        GPU reuse also needs a declared, admitted deployment profile; a deployment opts in.
    minimum_estimated_ttft_saving_ms = 10.0
        A saving under 10 ms is within one engine step and the scheduling jitter of
        serving stacks; it does not justify touching another worker's memory.
    minimum_transfer_prefix_blocks = 4
        A second gate, independent of the cost figures: fewer than 4 blocks (64 tokens at
        block size 16) is too short a prefix to be worth a cross-worker load even when a
        mis-set cost figure says otherwise.
    transfer_source_estimated_block_us = 135.0
        Host-resident source: 2 MiB over PCIe 4.0 x16 (31.5 GB/s per direction, PCI-SIG)
        at half of peak is 133 us, rounded up.
    transfer_source_gpu_estimated_block_us = 10.0
        GPU-resident source: 2 MiB over H100 NVLink (450 GB/s per direction; NVIDIA H100
        datasheet, 900 GB/s total) at half of peak is 9.3 us, rounded up.
    transfer_source_lookup_budget_ms = 2.0
        The inventory lookup sits on the TTFT path; it may take at most a fifth of the
        minimum saving, so a lookup that finds nothing costs little.
    transfer_source_prefill_token_us = 16.0
        Prefill costs about 2 FLOPs per parameter per token (Kaplan et al. 2020, "Scaling
        Laws for Neural Language Models"): 16 GFLOP for 8.0 B parameters, over an H100
        SXM's 989 dense bf16 TFLOPS (NVIDIA datasheet) at full peak: 16.2 us, rounded
        down. Full peak underestimates the cost, so the saving is never overstated.
    """

    enable_decode_to_prefill_reuse: bool = attrs.field(default=False, validator=_check_bool)
    enable_decode_to_prefill_gpu_reuse: bool = attrs.field(default=False, validator=_check_bool)
    minimum_estimated_ttft_saving_ms: float = attrs.field(default=10.0, converter=_to_float,
                                                          validator=_check_amount)
    minimum_transfer_prefix_blocks: int = attrs.field(default=4, validator=_check_count)
    transfer_source_estimated_block_us: float = attrs.field(default=135.0, converter=_to_float,
                                                            validator=_check_amount)
    transfer_source_gpu_estimated_block_us: float = attrs.field(default=10.0, converter=_to_float,
                                                                validator=_check_amount)
    transfer_source_lookup_budget_ms: float = attrs.field(default=2.0, converter=_to_float,
                                                          validator=_check_amount)
    transfer_source_prefill_token_us: float = attrs.field(default=16.0, converter=_to_float,
                                                          validator=_check_amount)

    # -- strict loading --

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object], *, base: ReuseSettings | None = None,
                     source: str = "mapping") -> ReuseSettings:
        """Settings from ``mapping`` (name -> value) over ``base`` (default: the defaults).

        Values may be typed (bool, int, float) or text, which is parsed strictly: booleans
        are exactly ``true``, ``false``, ``1`` or ``0``. Unknown names raise
        :class:`ConfigInvalid` (UNKNOWN_SETTING); bad values raise :class:`ConfigInvalid` (INVALID_SETTING).
        """
        base = _base(cls, base)
        if not isinstance(mapping, Mapping):
            raise ConfigInvalid.invalid_setting("mapping", type(mapping).__name__,
                                                "settings must be a mapping of name to value", source)
        changes: dict[str, Any] = {}  # values of any type: the class validators check each
        for name, value in mapping.items():
            if name not in SETTING_NAMES:
                raise ConfigInvalid.unknown_setting(str(name), source, SETTING_NAMES)
            changes[name] = _parse_value(name, value, source)
        try:
            return attrs.evolve(base, **changes)
        except ConfigInvalid as exc:
            if exc.reason is not ConfigReason.INVALID_SETTING:
                raise
            raise ConfigInvalid.invalid_setting(str(exc.name), exc.value, str(exc.problem), source) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 base: ReuseSettings | None = None) -> ReuseSettings:
        """Settings from ``KVSTATE_POLICY_<NAME>`` variables; any other such name is unknown."""
        environ = os.environ if environ is None else environ
        if not isinstance(environ, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in environ.items()):
            raise ConfigInvalid.invalid_setting("environ", type(environ).__name__, "must map names to strings",
                                                "environment")
        base = _base(cls, base)
        found: dict[str, object] = {}
        for var, value in environ.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX):].lower()
            if name not in SETTING_NAMES or var != env_var(name):
                raise ConfigInvalid.unknown_setting(var, "environment", [env_var(n) for n in SETTING_NAMES])
            found[name] = value
        return cls.from_mapping(found, base=base, source="environment")

    @classmethod
    def from_cli(cls, argv: Sequence[str], *, base: ReuseSettings | None = None) -> ReuseSettings:
        """Settings from ``--name value`` or ``--name=value`` arguments, nothing else.

        Every argument must be a settings flag with a value; a flag given twice is refused.
        """
        if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or \
                not all(isinstance(a, str) for a in argv):
            raise ConfigInvalid.invalid_setting("argv", type(argv).__name__, "must be a sequence of strings",
                                                "command line")
        base = _base(cls, base)
        found: dict[str, object] = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            if not arg.startswith("--"):
                raise ConfigInvalid.invalid_setting(arg, arg, "expected a --setting flag", "command line")
            flag, eq, value = arg.partition("=")
            name = flag[2:].replace("-", "_")
            if name not in SETTING_NAMES or flag != cli_flag(name):
                raise ConfigInvalid.unknown_setting(flag, "command line", [cli_flag(n) for n in SETTING_NAMES])
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigInvalid.invalid_setting(name, None, f"{flag} needs a value", "command line")
                value = argv[i + 1]
                i += 1
            if name in found:
                raise ConfigInvalid.invalid_setting(name, value, f"{flag} is given twice", "command line")
            found[name] = value
            i += 1
        return cls.from_mapping(found, base=base, source="command line")

    @classmethod
    def load(cls, mapping: Mapping[str, object] | None = None,
             environ: Mapping[str, str] | None = None,
             argv: Sequence[str] | None = None) -> ReuseSettings:
        """Defaults, then ``mapping``, then the environment, then ``argv``: later sources win.

        ``environ=None`` reads ``os.environ``; pass ``{}`` to ignore the environment.
        """
        settings = cls.from_mapping(mapping or {})
        settings = cls.from_env(environ, base=settings)
        return cls.from_cli(argv or (), base=settings)

    def as_dict(self) -> dict[str, bool | int | float]:
        return attrs.asdict(self)


SETTING_NAMES: tuple[str, ...] = tuple(a.name for a in attrs.fields(ReuseSettings))
_BOOL_SETTINGS = frozenset(a.name for a in attrs.fields(ReuseSettings) if a.type in (bool, "bool"))
_COUNT_SETTINGS = frozenset(a.name for a in attrs.fields(ReuseSettings) if a.type in (int, "int"))


def _base(cls: type[ReuseSettings], base: object) -> ReuseSettings:
    if base is None:
        return cls()
    if not isinstance(base, ReuseSettings):
        raise ConfigInvalid.invalid_setting("base", type(base).__name__, "must be ReuseSettings or None")
    return base


def env_var(name: str) -> str:
    """The environment variable of setting ``name``."""
    return ENV_PREFIX + name.upper()


def cli_flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return "--" + name.replace("_", "-")


_TRUE = {"true": True, "1": True, "false": False, "0": False}


def _parse_value(name: str, value: object, source: str) -> object:
    if not isinstance(value, str):
        return value  # typed values are checked by the class validators
    if len(value) > MAX_SETTING_TEXT:
        raise ConfigInvalid.invalid_setting(name, value[:32] + "...", f"longer than {MAX_SETTING_TEXT} characters",
                                            source)
    text = value.strip()
    if name in _BOOL_SETTINGS:
        if text.lower() not in _TRUE:
            raise ConfigInvalid.invalid_setting(name, value, "must be true, false, 1 or 0", source)
        return _TRUE[text.lower()]
    if name in _COUNT_SETTINGS:
        if not (text.isascii() and text.isdigit()):
            raise ConfigInvalid.invalid_setting(name, value, "must be a non-negative integer", source)
        return int(text)
    try:
        number = float(text)
    except ValueError:
        raise ConfigInvalid.invalid_setting(name, value, "must be a number", source) from None
    return number


def add_setting_flags(parser: Any) -> None:
    """Add one ``--flag VALUE`` per setting to an argparse parser (for help and parsing).

    Values stay text; :func:`settings_from_flags` parses them strictly.
    """
    defaults = ReuseSettings()
    group = parser.add_argument_group("reuse settings (override KVSTATE_POLICY_* variables)")
    for name in SETTING_NAMES:
        group.add_argument(cli_flag(name), dest=f"setting_{name}", metavar="VALUE", default=None,
                           help=f"default: {getattr(defaults, name)}")


def settings_from_flags(namespace: Any, *, base: ReuseSettings | None = None) -> ReuseSettings:
    """Settings from the flags :func:`add_setting_flags` added, over ``base``."""
    given = {name: getattr(namespace, f"setting_{name}") for name in SETTING_NAMES
             if getattr(namespace, f"setting_{name}", None) is not None}
    return ReuseSettings.from_mapping(given, base=base, source="command line")


# -- the pure core (contract-checked) --------------------------------------------------


def estimated_saving_ms(saved_blocks: int, block_tokens: int, prefill_token_us: float,
                        block_transfer_us: float, lookup_ms: float) -> float:
    """The estimated TTFT saving of loading ``saved_blocks`` blocks instead of computing them.

    Checks INV-POLICY-MONOTONE.

    pre: 0 <= saved_blocks <= 2**40
    pre: 1 <= block_tokens <= 2**20
    pre: math.isfinite(prefill_token_us) and prefill_token_us >= 0
    pre: math.isfinite(block_transfer_us) and block_transfer_us >= 0
    pre: math.isfinite(lookup_ms) and lookup_ms >= 0
    post: __return__ >= -lookup_ms
    post: __return__ <= estimated_saving_ms(saved_blocks + 1, block_tokens, prefill_token_us, block_transfer_us, lookup_ms)
    """
    per_block_net_us = block_tokens * prefill_token_us - block_transfer_us
    # Factored as n * net (not n*a - n*b) so rounding is monotone in n too.
    gain_us = saved_blocks * per_block_net_us if per_block_net_us > 0 else 0.0
    return gain_us / 1000.0 - lookup_ms


def gate(enabled: bool, gpu_enabled: bool, gpu_admitted: bool, gpu_source: bool,
         saved_blocks: int, saving_ms: float, minimum_blocks: int, minimum_saving_ms: float) -> DecisionReason:
    """Apply the switches and both minimums to one chosen source.

    Checks INV-POLICY-DISABLED, INV-POLICY-GPU-GATED and INV-POLICY-MINIMUMS.

    pre: saved_blocks >= 0 and minimum_blocks >= 0
    post: __return__ != DecisionReason.CHOSEN or enabled
    post: __return__ != DecisionReason.CHOSEN or not gpu_source or (gpu_enabled and gpu_admitted)
    post: __return__ != DecisionReason.CHOSEN or saved_blocks >= minimum_blocks
    post: __return__ != DecisionReason.CHOSEN or saving_ms >= minimum_saving_ms
    """
    if not enabled:
        return DecisionReason.REUSE_DISABLED
    if gpu_source and not gpu_enabled:
        return DecisionReason.GPU_REUSE_DISABLED
    if gpu_source and not gpu_admitted:
        return DecisionReason.GPU_PROFILE_NOT_ADMITTED
    if saved_blocks < minimum_blocks:
        return DecisionReason.BELOW_MINIMUM_BLOCKS
    if not saving_ms >= minimum_saving_ms:  # written so that NaN is refused as well
        return DecisionReason.BELOW_MINIMUM_SAVING
    return DecisionReason.CHOSEN


# -- candidates, terms and decisions ---------------------------------------------------


def _require_blocks(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BLOCKS:
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"{name} must be an integer in 0..{MAX_BLOCKS}, got {value!r}")


def _require_block_tokens(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_TOKENS:
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"block_tokens must be an integer in 1..{MAX_BLOCK_TOKENS}, got {value!r}")


def _require_memory(value: object) -> None:
    if not isinstance(value, MemoryKind):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"memory must be a MemoryKind, got {value!r}")


def _check_blocks(inst: object, attribute: attrs.Attribute[int], value: object) -> None:
    _require_blocks(attribute.name, value)


def _check_source_id(inst: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"source_id must be a non-empty string, got {value!r}")


def _check_memory(inst: object, attribute: attrs.Attribute[MemoryKind], value: object) -> None:
    _require_memory(value)


@attrs.frozen
class Candidate:
    """A decode worker that advertises ``prefix_blocks`` blocks of the prompt's prefix."""

    source_id: str = attrs.field(validator=_check_source_id)
    prefix_blocks: int = attrs.field(validator=_check_blocks)
    memory: MemoryKind = attrs.field(validator=_check_memory)

    @property
    def gpu(self) -> bool:
        return self.memory is MemoryKind.DEVICE


@attrs.frozen
class SavingTerms:
    """Every term of one saving estimate, for explanation and logging."""

    saved_blocks: int
    tokens_avoided: int
    prefill_ms: float  # the prefill those tokens would cost
    transfer_ms: float  # the transfer of the saved blocks
    lookup_ms: float
    saving_ms: float
    memory: MemoryKind


def estimate_ttft_saving(saved_blocks: int, *, block_tokens: int, memory: MemoryKind,
                         settings: ReuseSettings) -> SavingTerms:
    """The saving, with its terms, of loading ``saved_blocks`` from a source in ``memory``."""
    _require_blocks("saved_blocks", saved_blocks)
    _require_block_tokens(block_tokens)
    _require_memory(memory)
    block_us = (settings.transfer_source_gpu_estimated_block_us if memory is MemoryKind.DEVICE
                else settings.transfer_source_estimated_block_us)
    lookup_ms = settings.transfer_source_lookup_budget_ms
    tokens = saved_blocks * block_tokens
    return SavingTerms(
        saved_blocks=saved_blocks,
        tokens_avoided=tokens,
        prefill_ms=tokens * settings.transfer_source_prefill_token_us / 1000.0,
        transfer_ms=saved_blocks * block_us / 1000.0,
        lookup_ms=lookup_ms,
        saving_ms=estimated_saving_ms(saved_blocks, block_tokens, settings.transfer_source_prefill_token_us,
                                      block_us, lookup_ms),
        memory=memory,
    )


@attrs.frozen
class Decision:
    """The policy's answer: :attr:`recommended` or not, and why, with every term."""

    reason: DecisionReason
    #: the chosen source, or the one the gates rejected; None when none was eligible
    source: Candidate | None
    terms: SavingTerms | None
    target_prefix_blocks: int
    minimum_blocks: int
    minimum_saving_ms: float
    #: candidates read before the lookup stopped, and those skipped with their reason
    considered: int
    skipped: tuple[tuple[Candidate, DecisionReason], ...]
    lookup_exhausted: bool

    @property
    def recommended(self) -> bool:
        return self.reason is DecisionReason.CHOSEN

    def explain(self) -> str:
        """A human-readable account of the decision and its terms."""
        verdict = "reuse" if self.recommended else "recompute"
        lines = [f"decision: {verdict} ({self.reason.value})",
                 f"target prefix: {self.target_prefix_blocks} blocks; candidates read: {self.considered}"
                 + ("; lookup budget spent" if self.lookup_exhausted else "")]
        if self.source is not None and self.terms is not None:
            t = self.terms
            lines += [
                f"source: {self.source.source_id} ({self.source.memory.value}, {self.source.prefix_blocks} blocks)",
                f"blocks saved: {t.saved_blocks}  tokens avoided: {t.tokens_avoided}",
                f"prefill avoided: {t.prefill_ms:.3f} ms  transfer: {t.transfer_ms:.3f} ms  "
                f"lookup: {t.lookup_ms:.3f} ms",
                f"estimated TTFT saving: {t.saving_ms:.3f} ms",
                f"gate minimum blocks: {t.saved_blocks} >= {self.minimum_blocks}: "
                + ("pass" if t.saved_blocks >= self.minimum_blocks else "fail"),
                f"gate minimum saving: {t.saving_ms:.3f} >= {self.minimum_saving_ms:.3f} ms: "
                + ("pass" if t.saving_ms >= self.minimum_saving_ms else "fail"),
            ]
        for cand, why in self.skipped:
            lines.append(f"skipped: {cand.source_id} ({cand.memory.value}, {cand.prefix_blocks} blocks): {why.value}")
        return "\n".join(lines)


def _now(clock: Callable[[], float]) -> float:
    now = clock()
    if isinstance(now, bool) or not isinstance(now, (int, float)) or now != now:
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"clock() must return seconds, got {now!r:.40}")
    return float(now)


def choose_transfer_source(target_prefix_blocks: int, candidates: Iterable[Candidate],
                           settings: ReuseSettings, *, block_tokens: int,
                           admitted: Admitted | None = None,
                           clock: Callable[[], float] = time.monotonic) -> Decision:
    """Choose a decode worker to load the prefix from, or say why not.

    ``candidates`` may be lazy (each item may be an inventory lookup); reading stops once
    ``transfer_source_lookup_budget_ms`` has passed on ``clock`` (seconds), and a candidate
    that arrives after the budget is not considered. ``admitted`` is the result of
    :func:`kvstate.reuse.profile.admit` for the declared deployment profile; without an admitted
    profile that allows GPU reuse, GPU-resident sources are not eligible.
    """
    _require_blocks("target_prefix_blocks", target_prefix_blocks)
    _require_block_tokens(block_tokens)
    if not isinstance(settings, ReuseSettings):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"settings must be ReuseSettings, got {type(settings).__name__}")
    if admitted is not None and not hasattr(admitted, "gpu_reuse_allowed"):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"admitted must be an admission (kvstate.reuse.profile.admit) or None, "
                              f"got {type(admitted).__name__}")
    if not callable(clock):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"clock must be callable, got {type(clock).__name__}")
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Iterable):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"candidates must be an iterable of Candidate values, got {type(candidates).__name__}")
    minimum_blocks = settings.minimum_transfer_prefix_blocks
    minimum_saving = settings.minimum_estimated_ttft_saving_ms

    def decision(reason: DecisionReason, source: Candidate | None = None, terms: SavingTerms | None = None,
                 considered: int = 0, skipped: Sequence[tuple[Candidate, DecisionReason]] = (),
                 exhausted: bool = False) -> Decision:
        return Decision(reason=reason, source=source, terms=terms, target_prefix_blocks=target_prefix_blocks,
                        minimum_blocks=minimum_blocks, minimum_saving_ms=minimum_saving,
                        considered=considered, skipped=tuple(skipped), lookup_exhausted=exhausted)

    if not settings.enable_decode_to_prefill_reuse:
        return decision(DecisionReason.REUSE_DISABLED)  # no lookup at all
    gpu_enabled = settings.enable_decode_to_prefill_gpu_reuse
    gpu_admitted = admitted is not None and admitted.gpu_reuse_allowed

    budget_s = settings.transfer_source_lookup_budget_ms / 1000.0
    start = _now(clock)
    considered = 0
    exhausted = False
    skipped: list[tuple[Candidate, DecisionReason]] = []
    best: tuple[Candidate, SavingTerms] | None = None
    pending = iter(candidates)
    while True:
        if _now(clock) - start > budget_s:
            exhausted = True  # do not start another lookup
            break
        try:
            cand = next(pending)
        except StopIteration:
            break
        if _now(clock) - start > budget_s:
            exhausted = True  # this one arrived too late; stop reading
            break
        if not isinstance(cand, Candidate):
            raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"candidates must be Candidate values, got {cand!r}")
        considered += 1
        if cand.gpu and not gpu_enabled:
            skipped.append((cand, DecisionReason.GPU_REUSE_DISABLED))
            continue
        if cand.gpu and not gpu_admitted:
            skipped.append((cand, DecisionReason.GPU_PROFILE_NOT_ADMITTED))
            continue
        if cand.prefix_blocks <= target_prefix_blocks:
            skipped.append((cand, DecisionReason.NO_LONGER_PREFIX))
            continue
        terms = estimate_ttft_saving(cand.prefix_blocks - target_prefix_blocks, block_tokens=block_tokens,
                                     memory=cand.memory, settings=settings)
        if best is None or (cand.prefix_blocks, terms.saving_ms) > (best[0].prefix_blocks, best[1].saving_ms):
            best = (cand, terms)
    if best is None:
        return decision(DecisionReason.NO_ELIGIBLE_SOURCE, considered=considered, skipped=skipped, exhausted=exhausted)
    cand, terms = best
    reason = gate(settings.enable_decode_to_prefill_reuse, gpu_enabled, gpu_admitted, cand.gpu, terms.saved_blocks, terms.saving_ms,
                  minimum_blocks, minimum_saving)
    return decision(reason, cand, terms, considered, skipped, exhausted)
