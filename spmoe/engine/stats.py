"""What the engine counts per phase of a step: target forwards over prompts ("prefill") and decode
tokens ("decode"), MTP forwards ("draft"): forwards, tokens fed and committed, seconds and
collectives; the acceptance of drafts per draft position, in all and by draft source, and the source
each draft was led by; and the counters since start that the server's metrics report, the Triton
kernel variants loaded in the process (`KernelCompiles`) among them."""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from spmoe.distributed import CommStats, count_collectives
from spmoe.engine.request import DraftCounts, EngineMetrics
from spmoe.engine.sequence import Batch, PartResult
from spmoe.layers.fused import TRITON_INSTALLED

PHASES = ("prefill", "decode", "draft")


@dataclass
class Phase:
    forwards: int = 0
    replays: int = 0  # forwards replayed from a CUDA graph
    tokens_fed: int = 0
    tokens_committed: int = 0
    seconds: float = 0.0
    collectives: CommStats = field(default_factory=CommStats)

    @contextmanager
    def measure(self):
        """Time the block and count its collectives into this phase."""
        began = time.perf_counter()
        with count_collectives(self.collectives):
            yield self
        self.seconds += time.perf_counter() - began

    def as_dict(self) -> dict:
        return {
            "forwards": self.forwards,
            "replays": self.replays,
            "tokens_fed": self.tokens_fed,
            "tokens_committed": self.tokens_committed,
            "seconds": self.seconds,
            "collectives": self.collectives.as_dict(),
        }


def describe_compile(hook_kwargs: dict) -> str:
    """A Triton kernel variant from the keywords Triton's post-compile hook is called with: the
    kernel, then its constexpr arguments and those specialised on their value ("=") and the
    arguments specialised on their alignment or divisibility (":"), by name, e.g.
    `_cache_rows_kernel(BLOCK=128, width: tt.divisibility=16)`. Triton's own `repr` keyword
    (triton 3.6) names no argument's specialisation, which is what tells one variant from
    another; it is the fallback where the keywords lack what this reads."""
    fn = hook_kwargs.get("fn")
    name = getattr(fn, "name", None) or "a Triton kernel"
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None)
    compiled = hook_kwargs.get("compile") or {}
    constants, configs = compiled.get("constants"), compiled.get("configs")

    def label(path) -> str:  # a tuple path of argument indices: (3,) is the 4th argument
        path = path if isinstance(path, tuple) else (path,)
        return names[path[0]] + "".join(f"[{i}]" for i in path[1:])

    try:  # inside Triton's launch: a keyword shaped otherwise falls back, never fails the launch
        parts = [f"{label(k)}={v}" for k, v in constants.items()]
        for path, attrs in configs[0].items():
            parts += [f"{label(path)}: {attr}={value}" for attr, value in attrs]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return str(hook_kwargs.get("repr") or name)
    return f"{name}({', '.join(parts)})"


class KernelCompiles:
    """The process's Triton kernel variants loaded (compiled, or read from Triton's disk cache), by
    Triton's post-compile hook: one hook for the process, chained to any that was there before.
    `names`: each as `describe_compile` gives it (the kernel and its arguments' specialisations),
    in load order; empty without Triton (CPU)."""

    names: list[str] = []
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed or not TRITON_INSTALLED:
            return
        import triton

        previous = triton.knobs.runtime.jit_post_compile_hook

        def counted(*args, **kwargs):
            cls.names.append(describe_compile(kwargs))
            if previous is not None:
                return previous(*args, **kwargs)
            return None

        triton.knobs.runtime.jit_post_compile_hook = counted
        cls._installed = True


class StepStats:
    """The per-phase statistics since `reset` (what `Engine.report` gives the batch job) and the
    counters since start (`totals`: generated tokens; drafts proposed, verified and accepted, per
    position too, in all and by source). `lookup`: the name of the lookup that leads a draft's first
    tokens (the rest are MTP's)."""

    def __init__(self, num_speculative_tokens: int, lookup: str | None = None):
        self.k, self.lookup = num_speculative_tokens, lookup
        self.reset_totals()
        self.reset()

    def reset_totals(self) -> None:
        """Start the counters since start afresh (the server's, once the engine is warm)."""
        self.totals = EngineMetrics(accepted_per_position=[0] * self.k)

    def reset(self) -> None:
        self.phases = {name: Phase() for name in PHASES}
        self.verify_steps = 0  # sequences whose drafts a target forward verified, summed over steps
        self.accepted_at = [0] * self.k  # verifications that accepted more than j drafts, per j
        self.by_source: dict[str, DraftCounts] = {}  # the same by source, since `reset`

    def target_phase(self, batch: Batch) -> Phase:
        return self.phases["decode" if batch.decode else "prefill"]

    def record(self, batch: Batch, results: list[PartResult]) -> None:
        """Count the step's committed tokens (in the phase of its target forward too) and the drafts
        it verified."""
        self.record_drafts(results)
        committed = sum(len(r.output.new_token_ids) for r in results if r.output is not None)
        self.totals.generated_tokens += committed
        self.target_phase(batch).tokens_committed += committed

    def record_drafts(self, results: list[PartResult]) -> None:
        """Count the drafts the results verified, in all and by source."""
        for result in results:
            part = result.part
            if part.draws and part.drafts:
                self.verify_steps += 1
                self.totals.drafts += 1
                self.totals.draft_proposed += len(part.drafts)
                self.totals.draft_accepted += result.accepted
                for j in range(result.accepted):
                    self.accepted_at[j] += 1
                    self.totals.accepted_per_position[j] += 1
                for counts in self._sources(part.lookup_drafts > 0):
                    counts.drafts += 1
                for j in range(len(part.drafts)):
                    for counts in self._sources(j < part.lookup_drafts):
                        counts.proposed += 1
                        counts.accepted += j < result.accepted
                        counts.accepted_per_position[j] += j < result.accepted

    def count_choices(self, drafts) -> None:
        """Count the source that leads each of a step's drafts (`Draft`s; "none": no tokens)."""
        for draft in drafts:
            source = (self.lookup if draft.from_lookup else "mtp") if draft.tokens else "none"
            for counts in self._named(source):
                counts.chosen += 1

    def _sources(self, from_lookup: bool) -> list[DraftCounts]:
        """The counters (since `reset`, since start) of the lookup's drafts or MTP's."""
        return self._named(self.lookup if from_lookup else "mtp")

    def _named(self, source: str) -> list[DraftCounts]:
        return [
            counts.setdefault(source, DraftCounts(accepted_per_position=[0] * self.k))
            for counts in (self.by_source, self.totals.by_source)
        ]

    def as_dict(self) -> dict:
        """The phases, the prefill / decode split of the time and the speculation figures."""
        decode = self.phases["decode"]
        decode_s = decode.seconds + self.phases["draft"].seconds
        stats = {
            "prefill_s": self.phases["prefill"].seconds,
            "decode_s": decode_s,
            "decode_tokens_per_s": decode.tokens_committed / decode_s if decode_s else 0.0,
            "phases": {name: phase.as_dict() for name, phase in self.phases.items()},
        }
        if self.k:
            steps, accepted = self.verify_steps, sum(self.accepted_at)
            proposed = sum(c.proposed for c in self.by_source.values())
            stats["speculative"] = {
                "num_speculative_tokens": self.k,
                "verify_steps": steps,
                "proposed": proposed,
                "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
                "per_position": [count / steps if steps else 0.0 for count in self.accepted_at],
                "by_source": {
                    name: {
                        "chosen": counts.chosen,
                        "drafts": counts.drafts,
                        "proposed": counts.proposed,
                        "accepted": counts.accepted,
                        "acceptance_rate": counts.accepted / counts.proposed
                        if counts.proposed
                        else 0.0,
                        "accepted_per_position": counts.accepted_per_position,
                    }
                    for name, counts in sorted(self.by_source.items())
                },
            }
        return stats
