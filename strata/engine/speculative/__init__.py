"""Speculative decoding on the engine's side: proposers of draft tokens (n-gram, suffix tree), the per-step draft
budget and the acceptance statistics. Verification happens in the sampler (strata.layers.sampler)."""
