"""What speculates, as the engine takes it: the draft sources (`Speculation`) and the settings of
vLLM's two lookups in the context (`NgramConfig`, `SuffixConfig`; `runner/lookup.py` runs them,
`runner/speculator.py` the draft step). Each record checks its values when it is made."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class NgramConfig:
    """vLLM's `ngram` keys (vLLM's defaults: both 5; one given, the other equals it)."""

    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    def __post_init__(self):
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(low) and _is_int(high) and 1 <= low <= high):
            raise ValueError(
                "ngram: expected integers 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={low!r}, prompt_lookup_max={high!r}"
            )


@dataclass(frozen=True, kw_only=True)
class SuffixConfig:
    """vLLM's `suffix` keys, without their `suffix_decoding_` prefix, with vLLM's defaults."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    def __post_init__(self):
        checks = (
            ("max_tree_depth", _is_int(self.max_tree_depth) and self.max_tree_depth >= 2, ">= 2"),
            (
                "max_cached_requests",
                _is_int(self.max_cached_requests) and self.max_cached_requests >= 0,
                ">= 0",
            ),
            (
                "max_spec_factor",
                _is_number(self.max_spec_factor) and self.max_spec_factor > 0,
                "> 0",
            ),
            (
                "min_token_prob",
                _is_number(self.min_token_prob) and 0 <= self.min_token_prob <= 1,
                "in [0, 1]",
            ),
        )
        for name, good, expected in checks:
            if not good:
                raise ValueError(
                    f"suffix: suffix_decoding_{name} must be {expected}, got "
                    f"{getattr(self, name)!r}"
                )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and value == value


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """What drafts: `num_speculative_tokens` slots per sequence and step (0: no speculation), by the
    MTP layer (`mtp`), by a context lookup (`lookup`: an `NgramConfig` or a
    `SuffixConfig`), or both."""

    num_speculative_tokens: int = 0
    mtp: bool = True
    lookup: NgramConfig | SuffixConfig | None = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if k and not self.mtp and self.lookup is None:
            raise ValueError(
                f"{k} speculative tokens need a draft source: the MTP layer, a lookup, or both"
            )

    @property
    def mtp_drafts(self) -> int:
        """The MTP layer's draft slots per step (0: it does not draft)."""
        return self.num_speculative_tokens if self.mtp else 0

    @property
    def lookup_name(self) -> str | None:
        """vLLM's name of the lookup method, or None."""
        if self.lookup is None:
            return None
        return "ngram" if isinstance(self.lookup, NgramConfig) else "suffix"
