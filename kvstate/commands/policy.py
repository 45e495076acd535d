"""``kvstate policy explain``: the reuse decision for given inputs, with every term.

Example::

    kvstate policy explain --target-blocks 8 --block-tokens 16 \\
        --candidate decode-0:host:200 --candidate decode-1:device:180 \\
        --enable-decode-to-prefill-reuse true

Settings come from the defaults, then ``KVSTATE_POLICY_*`` variables, then the flags.
GPU-resident candidates need ``--profile`` and ``--capabilities`` (a published capability
set as JSON) that the profile admits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstate.reuse import policy, profile
from kvstate.core.errors import ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.core.capabilities import MemoryKind

help = "explain the reuse policy's decision for given inputs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["explain"], help="explain: print the decision and its terms")
    parser.add_argument("--target-blocks", type=int, required=True,
                        help="prefix blocks the prefill worker already holds")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--candidate", action="append", default=[], metavar="ID:host|device:BLOCKS",
                        help="a decode worker and the prefix it retains (repeatable)")
    parser.add_argument("--profile", help="declared deployment profile: "
                        + ", ".join(p.value for p in profile.DeploymentProfile))
    parser.add_argument("--capabilities", type=Path, help="published capabilities (JSON file)")
    parser.add_argument("--json", action="store_true", help="print the decision as JSON")
    policy.add_setting_flags(parser)


def _candidate(text: str) -> policy.Candidate:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"--candidate {text!r}: expected ID:host|device:BLOCKS")
    try:
        memory = MemoryKind(parts[1])
    except ValueError:
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT,
                              f"--candidate {text!r}: memory must be host or device") from None
    return policy.Candidate(parts[0], int(parts[2]), memory)


def run(args: argparse.Namespace) -> int:
    settings = policy.settings_from_flags(args, base=policy.ReuseSettings.from_env())
    candidates = [_candidate(c) for c in args.candidate]
    admitted: profile.Admitted | None = None
    if (args.profile is None) != (args.capabilities is None):
        raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, "--profile and --capabilities go together")
    if args.profile is not None:
        declared = profile.DeploymentProfile.parse(args.profile)
        try:
            with open(args.capabilities, "rb") as f:
                text = f.read(profile.MAX_CAPABILITIES_BYTES + 1)
            if len(text) > profile.MAX_CAPABILITIES_BYTES:
                raise ValueError(f"larger than {profile.MAX_CAPABILITIES_BYTES} bytes")
            wire = json.loads(text.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise ArgumentInvalid(ArgumentReason.POLICY_INPUT, f"--capabilities {args.capabilities}: {exc}") from None
        outcome = profile.admit(declared, profile.parse_capabilities(wire))
        if isinstance(outcome, profile.Refused):
            for r in outcome.reasons:
                print(f"profile {declared.value} refused: {r.rule.value}: {r.detail}", file=sys.stderr)
        else:
            admitted = outcome
    decision = policy.choose_transfer_source(args.target_blocks, candidates, settings,
                                             block_tokens=args.block_tokens, admitted=admitted)
    if args.json:
        print(json.dumps(_as_json(decision, settings), indent=2))
    else:
        print(decision.explain())
    return 0


def _as_json(d: policy.Decision, settings: policy.ReuseSettings) -> dict[str, object]:
    terms = None
    if d.terms is not None:
        t = d.terms
        terms = {"saved_blocks": t.saved_blocks, "tokens_avoided": t.tokens_avoided,
                 "prefill_ms": t.prefill_ms, "transfer_ms": t.transfer_ms, "lookup_ms": t.lookup_ms,
                 "saving_ms": t.saving_ms, "memory": t.memory.value}
    return {
        "recommended": d.recommended,
        "reason": d.reason.value,
        "source": None if d.source is None else d.source.source_id,
        "terms": terms,
        "gates": {"minimum_blocks": d.minimum_blocks, "minimum_saving_ms": d.minimum_saving_ms},
        "skipped": [{"source": c.source_id, "reason": r.value} for c, r in d.skipped],
        "settings": settings.as_dict(),
    }
