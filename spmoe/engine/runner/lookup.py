"""Drafts found in the context, on the host: vLLM's `ngram` and `suffix` speculative methods.

Both look for earlier occurrences of the sequence's last tokens and propose what followed them. A
draft is a deterministic proposal (its q is one-hot), so the target keeps it by the one-hot rule
(`sampling/rejection.py`): greedy output stays the target's own, sampled output keeps
its distribution.

- `NgramLookup` (`prompt_lookup_min`, `prompt_lookup_max`, as vLLM names them): the longest n-gram,
  n in [min, max], that ends the sequence's tokens (prompt and output) and occurred earlier in them;
  the tokens after its most recent earlier occurrence are the drafts.
- `SuffixLookup` (suffix decoding, Oliaro et al. 2024, arXiv:2411.04975; vLLM's `suffix_decoding_*`
  keys): the longest suffix of the sequence's tokens that occurs in its own tokens or in the outputs
  of the `max_cached_requests` most recently finished requests (oldest out first); among the
  occurrences that match it, the continuation is the most frequent next token, step by step, while
  its share of the occurrences that still agree is at least `min_token_prob`. The match counts up to
  `max_tree_depth / (1 + max_spec_factor)` tokens, and the draft is at most `max_spec_factor` times
  the match long, and match and draft together at most `max_tree_depth` tokens: the bounds
  vLLM's keys set.

Both read one index (`Corpus`): for each anchor length a, where each a-gram of the indexed texts
occurred (only occurrences followed by a token). State is kept per sequence (its own tokens, indexed
as they are committed) and dropped with the sequence.
"""

import weakref
from bisect import bisect_left
from collections import Counter, deque

from spmoe.engine.speculation import NgramConfig, SuffixConfig

CANDIDATES = 64  # the most recent occurrences of an anchor a suffix match starts from
SUFFIX_ANCHORS = (8, 4, 2)  # a suffix match starts from the longest of these that occurred


class Corpus:
    """Token texts (keyed by an increasing serial) and, per anchor length a in `anchors`, where each
    a-gram occurred: `(serial, position after it)`, oldest first, only where a token follows."""

    def __init__(self, anchors: tuple[int, ...]):
        self.anchors = anchors
        self.texts: dict[int, list[int]] = {}
        self.after: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def extend(self, serial: int, tokens: list[int]) -> None:
        """Append `tokens` to text `serial` (a new one if unknown) and index the
        anchors they end."""
        text = self.texts.setdefault(serial, [])
        old = len(text)
        text += tokens
        # an occurrence ending at e is indexed once text[e + 1] exists
        for end in range(max(old - 1, 0), len(text) - 1):
            for a in self.anchors:
                if end + 1 >= a:
                    gram = tuple(text[end + 1 - a : end + 1])
                    self.after.setdefault(gram, []).append((serial, end + 1))

    def drop_before(self, serial: int) -> None:
        """Forget the texts with a smaller serial (their occurrences are the head of each list)."""
        for old in [s for s in self.texts if s < serial]:
            del self.texts[old]
        for gram, places in list(self.after.items()):
            cut = bisect_left(places, (serial, -1))
            if cut == len(places):
                del self.after[gram]
            elif cut:
                del places[:cut]

    def occurrences(self, gram: tuple[int, ...], most: int) -> list[tuple[int, int]]:
        """The `most` most recent `(serial, position after it)` of `gram`, most recent first."""
        return self.after.get(gram, [])[-most:][::-1]


class _Own:
    """A sequence's own tokens as a corpus (serial 0), indexed as they are committed."""

    def __init__(self, anchors: tuple[int, ...]):
        self.corpus = Corpus(anchors)

    def update(self, seq) -> list[int]:
        """Index what `seq` committed since the last call. -> its tokens (prompt and output)."""
        prompt, done = seq.request.prompt, len(self.corpus.texts.get(0, []))
        self.corpus.extend(0, prompt[done:] + seq.output[max(done - len(prompt), 0) :])
        return self.corpus.texts[0]


class NgramLookup:
    """vLLM's `ngram` method over each sequence's prompt and output (see the module)."""

    name = "ngram"

    def __init__(self, config: NgramConfig):
        self.config = config
        sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self.sizes = tuple(sizes)
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, seq, k: int) -> list[int]:
        """Up to `k` drafts for running `seq` (its tokens as committed), or none without a match."""
        own = self.own.get(seq) or self.own.setdefault(seq, _Own(self.sizes))
        tokens = own.update(seq)
        for n in self.sizes:
            if len(tokens) > n:
                found = own.corpus.occurrences(tuple(tokens[-n:]), 1)
                if found:
                    start = found[0][1]
                    return tokens[start : start + k]
        return []

    def finished(self, seq) -> None:
        """`seq` ended: its index goes."""
        self.own.pop(seq, None)


class SuffixLookup:
    """Suffix decoding over each sequence's tokens and recent requests' outputs (see the module)."""

    name = "suffix"

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.recent = Corpus(SUFFIX_ANCHORS)  # finished requests' outputs, serial 1, 2, ...
        self.serials: deque[int] = deque()
        self.longest_match = int(config.max_tree_depth / (1 + config.max_spec_factor))

    def propose(self, seq, k: int) -> list[int]:
        """Up to `k` drafts for running `seq`, or none without a match."""
        own = self.own.get(seq) or self.own.setdefault(seq, _Own(SUFFIX_ANCHORS))
        tokens = own.update(seq)
        corpora = (own.corpus, self.recent)
        anchor = next(
            (a for a in SUFFIX_ANCHORS if any(c.after.get(tuple(tokens[-a:])) for c in corpora)),
            None,
        )
        if anchor is None or len(tokens) < anchor:
            return []
        gram, limit = tuple(tokens[-anchor:]), max(self.longest_match, anchor)
        matches = []  # (match length, text, position after the match)
        for corpus in corpora:
            for serial, after in corpus.occurrences(gram, CANDIDATES):
                text = corpus.texts[serial]
                length = anchor
                while (
                    length < limit
                    and length < after
                    and length < len(tokens)
                    and text[after - length - 1] == tokens[-length - 1]
                ):
                    length += 1
                matches.append((length, text, after))
        best = max(length for length, *_ in matches)
        config = self.config
        most = min(k, int(config.max_spec_factor * best), config.max_tree_depth - best)
        return _most_frequent_path(
            [(text, after) for length, text, after in matches if length == best],
            most,
            config.min_token_prob,
        )

    def finished(self, seq) -> None:
        """`seq` ended: its index goes, its output joins the recent requests' (oldest out first)."""
        self.own.pop(seq, None)
        if not self.config.max_cached_requests or not seq.output:
            return
        serial = self.serials[-1] + 1 if self.serials else 1
        self.serials.append(serial)
        self.recent.extend(serial, list(seq.output))
        if len(self.serials) > self.config.max_cached_requests:
            self.serials.popleft()
            self.recent.drop_before(self.serials[0])


def _most_frequent_path(
    places: list[tuple[list[int], int]], most: int, min_prob: float
) -> list[int]:
    """Occurrences `(text, position after the match)` -> up to `most` tokens: at each step the token
    that most of the occurrences still agreeing continue with, while its share is >= `min_prob`."""
    path = []
    while len(path) < most and places:
        j = len(path)
        counts = Counter(text[after + j] for text, after in places if after + j < len(text))
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        if count < min_prob * len(places):
            break
        path.append(token)
        places = [(t, a) for t, a in places if a + j < len(t) and t[a + j] == token]
    return path
