"""Workloads for the reference engine: who sends which tokens, and when.

A workload is a list of :class:`Session` objects. A session is a sequence of turns; turn ``k``'s
prompt is turn ``k-1``'s prompt + its generated answer + the new message, so a session can only
submit its next turn once the previous one finished (the engine does that, ``think_steps``
later). Token ids are drawn from a seeded generator, so a workload is a pure function of its
name, size and seed.

- ``chat``: multi-turn conversations, each user with their own history.
- ``shared``: many users behind one long system prompt (one or two turns each).
- ``docqa``: several questions about each of a few long documents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.errors import ConfigError

__all__ = ["Session", "Turn", "WORKLOADS", "make_workload"]

WORKLOADS = ("chat", "shared", "docqa")
_FIRST_TOKEN = 3  # 0..2 are reserved (padding, BOS, EOS)


@dataclass(frozen=True, slots=True)
class Turn:
    """The new tokens a user sends, and how many tokens the answer may have at most."""

    message: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """One user: the first turn arrives at ``start_step``; the next ones after each answer."""

    session_id: str
    start_step: int
    turns: tuple[Turn, ...]
    think_steps: int = 2


def _tokens(rng: random.Random, count: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_FIRST_TOKEN, vocab) for _ in range(count))


def make_workload(name: str, *, requests: int, seed: int = 0, vocab: int = 32000, scale: float = 1.0) -> list[Session]:
    """About ``requests`` requests (turns) of workload ``name``. ``scale`` multiplies lengths."""
    if name not in WORKLOADS:
        raise ConfigError(f"workload: unknown workload {name!r}; expected one of {list(WORKLOADS)}")
    if requests < 1:
        raise ConfigError(f"requests: expected a positive number, got {requests}")
    rng = random.Random(f"{name}:{seed}")

    def length(lo: int, hi: int) -> int:
        return max(1, int(rng.randint(lo, hi) * scale))

    sessions: list[Session] = []
    if name == "chat":
        turns_each = 4
        count = max(1, -(-requests // turns_each))
        system = _tokens(rng, length(96, 96), vocab)
        for i in range(count):
            n_turns = min(turns_each, requests - i * turns_each)
            turns = []
            for t in range(n_turns):
                first = system if t == 0 else ()
                turns.append(Turn(first + _tokens(rng, length(48, 160), vocab), length(24, 64)))
            sessions.append(Session(f"chat-{i}", start_step=i * 3, turns=tuple(turns), think_steps=rng.randint(1, 4)))
    elif name == "shared":
        system = _tokens(rng, length(640, 640), vocab)
        i = 0
        remaining = requests
        while remaining > 0:
            n_turns = min(remaining, rng.choice((1, 2)))
            turns = [Turn(system + _tokens(rng, length(24, 96), vocab), length(16, 48))]
            turns += [Turn(_tokens(rng, length(16, 64), vocab), length(16, 48)) for _ in range(n_turns - 1)]
            sessions.append(Session(f"user-{i}", start_step=i * 2, turns=tuple(turns)))
            remaining -= n_turns
            i += 1
    else:  # docqa
        per_doc = 5
        docs = max(1, -(-requests // per_doc))
        made = 0
        for d in range(docs):
            doc = _tokens(rng, length(900, 1100), vocab)
            for q in range(per_doc):
                if made == requests:
                    break
                question = _tokens(rng, length(16, 48), vocab)
                # Questions about one document trickle in; documents overlap in time.
                start = d * 12 + q * rng.randint(2, 6)
                sessions.append(
                    Session(f"doc{d}-q{q}", start_step=start, turns=(Turn(doc + question, length(16, 40)),))
                )
                made += 1
    sessions.sort(key=lambda s: (s.start_step, s.session_id))
    return sessions
