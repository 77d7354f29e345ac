"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from tandem.config import SpeculativeConfig
from tandem.speculative.ngram import NgramProposer
from tandem.speculative.proposer import Proposer
from tandem.speculative.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
