"""A suffix tree of bounded depth over several token sequences, with occurrence counts (SuffixDecoding's index,
arXiv 2411.04975): every suffix of every sequence, cut to `max_depth` tokens, is a path from the root; a node counts
the suffixes that pass through it, so a child's count over its parent's is how often that token followed.

Sequences grow one token at a time: the suffixes still shorter than `max_depth` (at most that many per sequence)
each step one token down. A node holds a run of tokens by reference (a sequence and a range of it), so text seen
once costs one node per suffix, not one per token; a run splits where another suffix leaves it.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


class _Node:
    __slots__ = ("best", "children", "count", "end", "seq", "start")

    def __init__(self, seq: list[int] | None, start: int, end: int) -> None:
        self.seq, self.start, self.end = seq, start, end  # the node's tokens: seq[start:end]
        self.count = 0  # suffixes that pass through (or end at) this node
        self.children: dict[int, _Node] | None = None  # by first token
        self.best: _Node | None = None  # the child with the highest count

    def grow_best(self, child: _Node) -> None:
        """`child`'s count went up: it may now be the most frequent."""
        if self.best is None or child.count > self.best.count:
            self.best = child


@dataclass
class Draft:
    token_ids: list[int]
    score: float = 0.0  # the sum of the tokens' estimated probabilities
    match_len: int = 0  # context tokens matched before the draft


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(None, 0, 0)
        self.sequences: dict[Hashable, list[int]] = {}
        # The nodes where each growing sequence's suffixes shorter than max_depth end, and their lengths.
        self._active: dict[Hashable, list[tuple[_Node, int]]] = {}

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append tokens to a sequence (a new one if `seq_id` is unknown); its new suffixes join the tree."""
        seq = self.sequences.setdefault(seq_id, [])
        active = self._active.get(seq_id, [])
        for token in tokens:
            n = len(seq)
            seq.append(token)
            active.append((self.root, 0))  # the suffix that starts at this token
            active = [(self._step(node, token, seq, n), depth + 1) for node, depth in active]
            if active[0][1] == self.max_depth:  # the oldest suffix reached the depth limit
                del active[0]
        self._active[seq_id] = active

    def end(self, seq_id: Hashable) -> None:
        """The sequence grows no more (its suffixes stay in the tree until `remove`)."""
        self._active.pop(seq_id, None)

    def _step(self, node: _Node, token: int, seq: list[int], n: int) -> _Node:
        """One suffix, ending at `node`, grows by `token` (= seq[n]); returns the node it now ends at."""
        if node.children is None and node.count == 1 and node.seq is seq and node.end == n and node is not self.root:
            node.end = n + 1  # a run only this suffix passes, ending where its sequence does: it grows in place
            return node
        if node.children is None:
            node.children = {}
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node(seq, n, n + 1)
        elif child.end - child.start > 1:
            child = self._split(node, child)
        child.count += 1
        if node is not self.root:  # the root's best child is never asked for
            node.grow_best(child)
        return child

    @staticmethod
    def _split(parent: _Node, node: _Node) -> _Node:
        """Cut `node`'s first token into a new node between it and `parent`; suffixes ending at `node` still do."""
        head = _Node(node.seq, node.start, node.start + 1)
        head.count = node.count
        node.start += 1
        head.children = {node.seq[node.start]: node}
        head.best = node
        token = head.seq[head.start]
        parent.children[token] = head
        if parent.best is node:
            parent.best = head
        return head

    def remove(self, seq_id: Hashable) -> None:
        """Take a sequence's suffixes out of the tree (its nodes' counts drop; unused nodes go)."""
        seq = self.sequences.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            self._remove_suffix(seq, start, min(start + self.max_depth, len(seq)))

    def _remove_suffix(self, seq: list[int], start: int, stop: int) -> None:
        node, i = self.root, start
        while i < stop:
            child = node.children[seq[i]]
            child.count -= 1
            if child.count == 0:  # nothing else passes here (nor below)
                del node.children[seq[i]]
            if node is not self.root and (node.best is child or child.count == 0):
                node.best = max(node.children.values(), key=lambda c: c.count) if node.children else None
            if child.count == 0:
                return
            node, i = child, i + child.end - child.start

    def _match(self, context: list[int]) -> tuple[_Node, int] | None:
        """The node where `context` ends when read from the root, and how many of its tokens it used."""
        node, used = self.root, 0
        for token in context:
            if used == node.end - node.start:
                node = node.children.get(token) if node.children else None
                if node is None:
                    return None
                used = 1
            elif node.seq[node.start + used] == token:
                used += 1
            else:
                return None
        return node, used

    @staticmethod
    def _follow(node: _Node, used: int, max_tokens: int, min_prob: float) -> Draft:
        """The most frequent path on from a matched point, while each token's estimated probability (the product
        of child-over-parent counts so far) stays at least `min_prob`."""
        draft, prob = Draft([]), 1.0
        while len(draft.token_ids) < max_tokens and prob >= min_prob:
            if used < node.end - node.start:
                draft.token_ids.append(node.seq[node.start + used])
                draft.score += prob
                used += 1
            elif node.best is None:
                break
            else:
                prob *= node.best.count / node.count
                node, used = node.best, 0
        return draft

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float, min_prob: float) -> Draft:
        """The best draft over every matched suffix of `context`: a match of m tokens may propose up to
        m * max_spec_factor tokens; the highest score wins, the longer match on a tie."""
        best = Draft([])
        context = context[-self.max_depth:]
        for m in range(1, len(context) + 1):
            found = self._match(context[len(context) - m:])
            if found is None:
                break
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            draft = self._follow(*found, limit, min_prob)
            if draft.token_ids and draft.score >= best.score:
                draft.match_len = m
                best = draft
        return best
