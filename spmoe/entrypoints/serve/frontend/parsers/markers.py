"""Finding markers (tags, stop strings) in text that arrives in pieces."""


def partial_marker_length(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """The length of the longest end of `text` that is the beginning of one of `markers` (and not a
    whole marker): the text that must be held back until the next piece tells whether a marker
    starts there."""
    return max(
        (
            n
            for marker in markers
            for n in range(1, min(len(marker), len(text) + 1))
            if text.endswith(marker[:n])
        ),
        default=0,
    )
