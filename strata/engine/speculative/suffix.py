"""SuffixDecoding proposals (vLLM's `suffix` method): a suffix tree of each running request's prompt and output,
and one shared tree of recent requests' outputs; the draft continues the best-scoring match of the sequence's
latest tokens in either, as long as the match supports (suffix_decoding_max_spec_factor tokens per matched token)
and while its tokens stay likely (suffix_decoding_min_token_prob)."""
from __future__ import annotations

from collections import OrderedDict

from strata.config.speculative_config import SpeculativeConfig
from strata.engine.request import Request
from strata.engine.speculative.suffix_tree import SuffixTree


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests  # 0: no shared tree; -1: no limit
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.local: dict[str, tuple[SuffixTree, list[int]]] = {}  # request id -> (its tree, tokens indexed: [n])
        self.shared = SuffixTree(self.depth)  # outputs of recent requests, running ones included
        self.cached: OrderedDict[str, None] = OrderedDict()  # whose outputs the shared tree holds, oldest first

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tree = self._sync(request)
        context = request.token_ids[-self.depth:]
        draft = tree.speculate(context, max_tokens, self.spec_factor, self.min_prob)
        if self.max_cached != 0:
            shared = self.shared.speculate(context, max_tokens, self.spec_factor, self.min_prob)
            if shared.score > draft.score:
                draft = shared
        return draft.token_ids

    def finish(self, request: Request) -> None:
        """The request's output joins the shared tree (the rest of it, or all of it when no draft was ever asked
        for: while steps are full no request drafts, and none builds a tree of its prompt); its own tree goes."""
        request_id = request.request_id
        entry = self.local.pop(request_id, None)
        if entry is None:
            self._cache(request_id)
            new = request.output_token_ids
        else:
            new = request.token_ids[entry[1][0]:]
        if request_id in self.cached:
            self.shared.extend(request_id, new)
        self.shared.end(request_id)

    def _sync(self, request: Request) -> SuffixTree:
        """The request's tree, first built from its prompt; tokens generated since the last call join it (and the
        shared tree, while the request's output is cached there)."""
        request_id = request.request_id
        entry = self.local.get(request_id)
        if entry is None:
            tree = SuffixTree(self.depth)
            tree.extend(0, request.prompt_token_ids)
            entry = self.local[request_id] = (tree, [request.num_prompt_tokens])
            self._cache(request_id)
        tree, indexed = entry
        new = request.token_ids[indexed[0]:]
        if new:
            tree.extend(0, new)
            if request_id in self.cached:
                self.shared.extend(request_id, new)
            indexed[0] = request.num_tokens
        return tree

    def _cache(self, request_id: str) -> None:
        """Make room for the request's output in the shared tree, evicting the oldest cached outputs."""
        if self.max_cached == 0:
            return
        self.cached[request_id] = None
        while self.max_cached > 0 and len(self.cached) > self.max_cached:
            oldest, _ = self.cached.popitem(last=False)
            self.shared.remove(oldest)
