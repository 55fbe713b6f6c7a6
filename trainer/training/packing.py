"""Packed micro-batches: sequences laid end to end with no padding, and a shared prompt computed once.

Pure: token ids in, index lists out; no model, no torch. The backend turns a `PackedLayout` into tensors
(trainer.backends.packed_forward) and the packed attention keeps every sequence to its own tokens.

A *tree* is a set of sequences whose first `prefix_len` input tokens are equal (a GRPO group's shared prompt, or
the service's datums that share a prefix): the prefix is laid out once and each member adds only its own tail
(its *branch*). Every token's hidden state then depends only on its own sequence's tokens, so the logprobs and
gradients are those of the sequences computed one by one; the prefix's backward gathers what every branch sends it.

Trees are found from the token ids alone (sorted order, longest common prefixes), so they need no group structure
from run-api: identical prompts in two groups share one prefix too, and the service's datums are handled the same
way. A prefix shorter than `min_prefix` tokens is not worth the bookkeeping and is not shared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

# The keys the packed attention reads per computed token, at most: a branch reads its prefix's keys as well as its
# own, so a micro-batch of shared prefixes reads more keys than it computes tokens. The plan keeps them within this
# many times its token budget, and the memory plan counts that many gathered keys and values per token.
KEYS_PER_TOKEN = 2


@dataclass(frozen=True)
class Tree:
    """Sequences (indices into the caller's list) whose first `prefix_len` input tokens are one shared prefix.
    A lone sequence is a tree of one with prefix_len 0."""

    members: tuple[int, ...]
    prefix_len: int

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens this tree computes: the prefix once, then each member's tail."""
        return self.prefix_len + sum(lengths[i] - self.prefix_len for i in self.members)

    def keys(self, lengths: Sequence[int]) -> int:
        """Keys its attention reads: the prefix's own, and each member's whole length (prefix and tail)."""
        return self.prefix_len + sum(lengths[i] for i in self.members)

    def fits(self, lengths: Sequence[int], budget: int) -> bool:
        return self.cost(lengths) <= budget and self.keys(lengths) <= KEYS_PER_TOKEN * budget


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_trees(sequences: Sequence[Sequence[int]], min_prefix: int) -> list[Tree]:
    """Cover every sequence with trees computing the fewest tokens. In lexicographic order, sequences sharing a
    prefix are neighbours and a run's common prefix is the smallest neighbour-to-neighbour one; a run either is
    one tree, or splits where that smallest one occurs, whichever computes less (so a sequence sharing only a few
    tokens does not shorten what a group shares). min_prefix <= 0 turns sharing off."""
    if not sequences:
        return []
    order = sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i))
    lcps = [common_prefix_len(sequences[a], sequences[b]) for a, b in itertools.pairwise(order)]
    lengths = [len(s) for s in sequences]
    return _best_trees(order, lcps, lengths, min_prefix)[1]


MAX_SPLIT_DEPTH = (
    64  # nested shared prefixes followed this deep; deeper, a run is one tree or single sequences
)


def _best_trees(
    run: list[int], lcps: list[int], lengths: Sequence[int], min_prefix: int, depth: int = 0
) -> tuple[int, list[Tree]]:
    """(tokens computed, trees) for a run of sequences in sorted order; lcps[j] is between run[j] and run[j+1]."""
    if len(run) == 1 or min_prefix <= 0:
        return sum(lengths[i] for i in run), [Tree((i,), 0) for i in run]
    shared = min(lcps)
    if depth >= MAX_SPLIT_DEPTH:  # a chain of ever longer shared prefixes: bounded, not a RecursionError
        if shared >= min_prefix:
            whole = Tree(tuple(run), shared)
            return whole.cost(lengths), [whole]
        return sum(lengths[i] for i in run), [Tree((i,), 0) for i in run]
    pieces: list[tuple[int, list[Tree]]] = []
    start = 0
    for j, lcp in enumerate(lcps):
        if lcp == shared:
            pieces.append(_best_trees(run[start : j + 1], lcps[start:j], lengths, min_prefix, depth + 1))
            start = j + 1
    pieces.append(_best_trees(run[start:], lcps[start:], lengths, min_prefix, depth + 1))
    split_cost = sum(cost for cost, _ in pieces)
    if shared >= min_prefix:
        whole = Tree(tuple(run), shared)
        if whole.cost(lengths) <= split_cost:
            return whole.cost(lengths), [whole]
    return split_cost, [tree for _, trees in pieces for tree in trees]


def _split_tree(tree: Tree, lengths: Sequence[int], budget: int) -> list[Tree]:
    """A tree over the budget (tokens, or keys) as several trees that fit, each computing the prefix again; a
    member longer than the budget alone is a tree of its own (its micro-batch is over budget, as in the padded
    plan; config validation keeps max_seq_len within the budget)."""
    if tree.fits(lengths, budget) or len(tree.members) == 1:
        return [tree]
    out: list[Tree] = []
    current: list[int] = []
    for i in tree.members:
        trial = Tree(tuple([*current, i]), tree.prefix_len)
        if current and not trial.fits(lengths, budget):
            out.append(Tree(tuple(current), tree.prefix_len if len(current) > 1 else 0))
            current = []
        current.append(i)
    out.append(Tree(tuple(current), tree.prefix_len if len(current) > 1 else 0))
    return out


def plan_packed_micro_batches(
    sequences: Sequence[Sequence[int]], token_budget: int, min_prefix: int
) -> list[list[Tree]]:
    """Trees grouped so that each micro-batch computes at most token_budget tokens and reads at most
    KEYS_PER_TOKEN x token_budget keys (first fit, largest first). Every sequence is in exactly one tree of
    exactly one micro-batch."""
    lengths = [len(s) for s in sequences]
    trees = [
        piece
        for tree in find_trees(sequences, min_prefix)
        for piece in _split_tree(tree, lengths, token_budget)
    ]
    trees.sort(key=lambda t: (-t.cost(lengths), t.members))
    bins: list[list[Tree]] = []
    room: list[tuple[int, int]] = []  # tokens and keys left
    for tree in trees:
        cost, keys = tree.cost(lengths), tree.keys(lengths)
        slot = next((b for b, (c, k) in enumerate(room) if cost <= c and keys <= k), None)
        if slot is None:
            bins.append([tree])
            room.append((token_budget - cost, KEYS_PER_TOKEN * token_budget - keys))
        else:
            bins[slot].append(tree)
            room[slot] = (room[slot][0] - cost, room[slot][1] - keys)
    return bins


@dataclass(frozen=True)
class Segment:
    """Queries at `rows` (consecutive positions of one sequence) that see the context rows `context` in full and
    their own rows causally. A prefix is a segment with no context; a branch's context is its tree's prefix."""

    rows: tuple[int, int]  # [start, end) in the packed row
    context: tuple[int, int]  # [start, end); empty for a prefix or a lone sequence

    @property
    def own_len(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def context_len(self) -> int:
        return self.context[1] - self.context[0]


@dataclass
class PackedLayout:
    """One micro-batch as a single row of `tokens` with RoPE `positions`; `rows[k][t]` is where member k's input
    position t was computed (its own branch, or the shared prefix); `members` are indices into the caller's list."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    members: list[int] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        return len(self.tokens)


def build_layout(sequences: Sequence[Sequence[int]], trees: Sequence[Tree]) -> PackedLayout:
    out = PackedLayout()
    for tree in trees:
        prefix = (len(out.tokens), len(out.tokens) + tree.prefix_len)
        if tree.prefix_len:
            out.tokens.extend(sequences[tree.members[0]][: tree.prefix_len])
            out.positions.extend(range(tree.prefix_len))
            out.segments.append(Segment(prefix, (prefix[0], prefix[0])))
        for i in tree.members:
            seq = sequences[i]
            start = len(out.tokens)
            tail = seq[tree.prefix_len :]
            out.tokens.extend(tail)
            out.positions.extend(range(tree.prefix_len, len(seq)))
            if tail:
                out.segments.append(Segment((start, start + len(tail)), prefix))
            out.members.append(i)
            out.rows.append(list(range(prefix[0], prefix[1])) + list(range(start, start + len(tail))))
    return out


def bucket_segments(segments: Sequence[Segment], max_waste: float = 0.5) -> list[list[int]]:
    """Segment indices in groups of similar size, each group computed as one padded attention batch: a segment
    joins the current group unless that would leave more than `max_waste` of the group's attention area padding."""
    order = sorted(
        range(len(segments)),
        key=lambda s: (-(segments[s].context_len + segments[s].own_len), -segments[s].own_len, s),
    )
    groups: list[list[int]] = []
    for s in order:
        if groups:
            group = groups[-1] + [s]
            width = max(segments[g].context_len + segments[g].own_len for g in group)
            height = max(segments[g].own_len for g in group)
            real = sum(segments[g].own_len * (segments[g].context_len + segments[g].own_len) for g in group)
            if real >= (1 - max_waste) * len(group) * width * height:
                groups[-1] = group
                continue
        groups.append([s])
    return groups
