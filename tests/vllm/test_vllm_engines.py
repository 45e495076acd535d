"""Real engines agree with each other: the base of every token-identity claim.

Two engines with the same seeded weights, alive at once, give the same greedy tokens; a
tp=2 engine gives the same tokens as tp=1 (in float32: see the tp_pair fixture).
"""

from __future__ import annotations

from support.engines.suite import MAX_TOKENS, PROMPT_LENGTHS, Run
from support.engines.evidence import reuse


def test_two_engines_give_identical_greedy_tokens(plain_pair: Run) -> None:
    a, b = plain_pair.generations["a"], plain_pair.generations["b"]
    assert [len(t) for t in a.tokens] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert a.tokens == b.tokens
    # Fresh engines reuse nothing: this is computation agreeing with computation.
    assert reuse(a).none_problems() == [] and reuse(b).none_problems() == []
    # Distinct prompts give distinct continuations, so agreement is not trivial.
    assert len({tuple(t) for t in a.tokens}) == len(PROMPT_LENGTHS)


def test_tp2_engine_matches_tp1(tp_pair: Run) -> None:
    tp1, tp2 = tp_pair.generations["tp1"], tp_pair.generations["tp2"]
    assert reuse(tp1).none_problems() == [] and reuse(tp2).none_problems() == []
    assert tp2.tokens == tp1.tokens
    assert len({tuple(t) for t in tp1.tokens}) == len(PROMPT_LENGTHS)
