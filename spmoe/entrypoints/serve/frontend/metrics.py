"""`/metrics` in the Prometheus text format, from the server's own registry.

vLLM's series keep vLLM's names, labels and buckets (the `vllm:` prefix, labels `model_name` and
`engine`, the buckets of vLLM 0.34's defaults), so that vLLM's Grafana dashboards and alerts read
spmoe unchanged; spmoe's own extra series carry the `spmoe:` prefix. docs/vllm-compatibility.md
lists them.

The engine's state (requests running and waiting, KV cache usage, generated tokens, preemptions, MTP
drafts, prefix cache queries and hits in tokens, and spmoe's steps, kernel compiles and CUDA graph
captures, and the engine process's seconds on the exchange with the front ends and idle) is read
from the engine client when Prometheus scrapes. The request metrics are recorded by the front end as
tokens reach it:
- `time_to_first_token_seconds`: from the request's arrival to its first generated token;
- `inter_token_latency_seconds`: between a request's successive tokens (a step that brings several
  tokens, accepted MTP drafts, counts as that many intervals of its time divided by the tokens);
- per finished request: `e2e_request_latency_seconds` (arrival to the last token),
  `request_decode_time_seconds` (first token to last), `request_time_per_output_token_seconds` (that
  over the tokens after the first; 0 for one token, as vLLM does), `request_prompt_tokens`,
  `request_generation_tokens`, and `request_success_total` by `finished_reason`; and from the
  engine's own clock (its first output carries the durations): `request_queue_time_seconds` (added
  to the engine to first scheduled), `request_prefill_time_seconds` (first scheduled to first token)
  and `request_inference_time_seconds` (that prefill time plus the decode time);
- per request admitted: `prompt_tokens_total`, `request_params_n`, `request_params_max_tokens` and
  `request_max_num_generation_tokens` (the largest max_tokens of its choices);
- per request accepted with a schema keyword its grammar leaves unenforced (schema_policy.py), once
  per keyword: spmoe's `structured_output_unenforced_keywords_total` by `keyword` (a JSON schema
  keyword, or "other").

With several front end processes each records its own requests, in prometheus_client's multiprocess
mode (as vLLM does): under `PROMETHEUS_MULTIPROC_DIR`, which rank 0 gives them all, so that a scrape
of any front end totals every front end's counters and histograms.
"""

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
VLLM = "vllm:"  # vLLM's series, under vLLM's names
OWN = "spmoe:"  # spmoe's extra series
LABELS = ("model_name", "engine")  # vLLM's labels of every series; `engine` is the engine's index
ENGINE = "0"  # spmoe serves through one engine loop (its DP groups are inside it)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, all exposed from 0
# vLLM 0.34's default buckets
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0),
)
N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineCollector:
    """The engine's snapshot as Prometheus metrics, taken at every scrape. With speculation on, the
    speculation counters: drafts verified, draft tokens proposed and accepted, and accepted drafts
    per position (label `position`, 0 for the first draft); acceptance rate = accepted / draft
    tokens, mean accepted length = 1 + accepted / drafts. vLLM's series count every draft source
    together; spmoe's series of the same names count them by source (label `draft_source`)."""

    def __init__(self, client, model_name: str):
        self.client, self.labels = client, [model_name, ENGINE]

    def collect(self):
        m = self.client.metrics()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        rows = [
            (gauge, VLLM, "num_requests_running", "Requests in the running batch", m.running),
            (gauge, VLLM, "num_requests_waiting", "Requests waiting to be scheduled", m.waiting),
            (gauge, VLLM, "kv_cache_usage_perc", "KV cache in use (1 = full)", m.kv_cache_usage),
            (counter, VLLM, "generation_tokens", "Tokens generated", m.generated_tokens),
            (
                counter,
                VLLM,
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                m.prefix_cache_queries,
            ),
            (
                counter,
                VLLM,
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                m.prefix_cache_hits,
            ),
            (counter, VLLM, "num_preemptions", "Running requests preempted", m.preemptions),
            (counter, OWN, "engine_steps", "Engine steps run", m.steps),
            (
                counter,
                OWN,
                "engine_steps_compiling",
                "Engine steps that compiled a kernel or captured a graph",
                m.steps_compiling,
            ),
            (counter, OWN, "kernel_compiles", "Triton kernel variants loaded", m.kernel_compiles),
            (counter, OWN, "cuda_graph_captures", "CUDA graphs captured", m.graph_captures),
            (
                counter,
                OWN,
                "compiles_after_ready",
                "Kernel compiles and CUDA graph captures after the server reported ready",
                m.compiles_after_ready,
            ),
            (
                counter,
                OWN,
                "engine_exchange_seconds",
                "Seconds the engine process spent on the front-end exchange "
                "(receive, decode, encode, send)",
                self.client.exchange_s,
            ),
            (
                counter,
                OWN,
                "engine_idle_seconds",
                "Seconds the engine process waited for requests with nothing to run",
                self.client.idle_s,
            ),
        ]
        if self.client.num_speculative_tokens:
            rows += [
                (counter, VLLM, "spec_decode_num_drafts", "Draft verifications", m.drafts),
                (
                    counter,
                    VLLM,
                    "spec_decode_num_draft_tokens",
                    "Draft tokens proposed",
                    m.draft_proposed,
                ),
                (
                    counter,
                    VLLM,
                    "spec_decode_num_accepted_tokens",
                    "Draft tokens accepted",
                    m.draft_accepted,
                ),
            ]
        for kind, prefix, name, text, value in rows:
            family = kind(prefix + name, text, labels=LABELS)
            family.add_metric(self.labels, value)
            yield family
        if self.client.num_speculative_tokens:
            per_position = CounterMetricFamily(
                VLLM + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts accepted, by draft position",
                labels=[*LABELS, "position"],
            )
            for position, count in enumerate(m.accepted_per_position):
                per_position.add_metric([*self.labels, str(position)], count)
            yield per_position
            yield from self.by_source(m)
        tables = GaugeMetricFamily(
            OWN + "request_table_entries",
            "Entries of a table kept per request (each 0 once the server is idle)",
            labels=[*LABELS, "table"],
        )
        for table, entries in sorted(m.request_tables.items()):
            tables.add_metric([*self.labels, table], entries)
        yield tables

    def by_source(self, m):
        """The same speculation counters by draft source (label `draft_source`: mtp, ngram, suffix),
        and the drafts each source led (`none`: a lookup alone without a match)."""
        labels = [*LABELS, "draft_source"]
        families = {
            "drafts": (
                "spec_decode_num_drafts",
                "Draft verifications, by the source of their first draft",
            ),
            "proposed": ("spec_decode_num_draft_tokens", "Draft tokens proposed, by source"),
            "accepted": ("spec_decode_num_accepted_tokens", "Draft tokens accepted, by source"),
            "chosen": ("spec_decode_num_led", "Drafts (a sequence's in a step) each source led"),
        }
        for field, (name, text) in families.items():
            family = CounterMetricFamily(OWN + name, text, labels=labels)
            for source, counts in sorted(m.by_source.items()):
                if source != "none" or field == "chosen":
                    family.add_metric([*self.labels, source], getattr(counts, field))
            yield family
        per_position = CounterMetricFamily(
            OWN + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted, by source and draft position",
            labels=[*labels, "position"],
        )
        for source, counts in sorted(m.by_source.items()):
            for position, count in enumerate(counts.accepted_per_position):
                if source != "none":
                    per_position.add_metric([*self.labels, source, str(position)], count)
        yield per_position


class ServeMetrics:
    def __init__(self, client, model_name: str):
        # what a scrape reads: the engine's snapshot, and the request metrics of this front end or,
        # in multiprocess mode, of every front end (the ones recorded here are then read from the
        # shared folder, not from this registry)
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(client, model_name))
        own = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            MultiProcessCollector(self.registry)
            own = CollectorRegistry()
        self.model_name = model_name
        labels = (model_name, ENGINE)
        tokens = token_buckets(client.max_model_len)

        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            made = Histogram(VLLM + name, text, LABELS, buckets=buckets, registry=own)
            return made.labels(*labels)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's tokens", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "A finished request's decode time per token after the first",
            ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Added to the engine to first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduled to last token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request", tokens
        )
        self.max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The largest max_tokens of a request", tokens
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of a request", tokens
        )
        self.params_n = histogram("request_params_n", "The n of a request", N_BUCKETS)
        self.prompt_tokens = Counter(
            VLLM + "prompt_tokens",
            "Prompt tokens of admitted requests",
            LABELS,
            registry=own,
        ).labels(*labels)
        finished = Counter(
            VLLM + "request_success",
            "Requests finished, by finished_reason",
            [*LABELS, "finished_reason"],
            registry=own,
        )
        self._finished = {reason: finished.labels(*labels, reason) for reason in FINISHED_REASONS}
        self._finished_family = finished
        self.unenforced_keywords = Counter(
            OWN + "structured_output_unenforced_keywords",
            "Requests accepted with a schema keyword the grammar does not enforce, by keyword",
            [*LABELS, "keyword"],
            registry=own,
        )

    def observe_unenforced_keywords(self, keywords: set[str]) -> None:
        """A request was accepted with these schema keywords unenforced (schema_policy.py)."""
        for keyword in keywords:
            self.unenforced_keywords.labels(self.model_name, ENGINE, keyword).inc()

    def observe_request(self, prompt_tokens: int, n: int, max_tokens: int) -> None:
        """A request was admitted: its prompt tokens (once per prompt), `n` and max_tokens."""
        self.prompt_tokens.inc(prompt_tokens)
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        self.max_num_generation_tokens.observe(max_tokens)

    def observe_tokens(self, count: int, since_last: float, first: bool) -> None:
        """`count` tokens arrived `since_last` seconds after the request's previous tokens (or its
        arrival)."""
        if first:
            self.time_to_first_token.observe(since_last)
            count -= 1
            since_last = 0.0
        for _ in range(count):
            self.inter_token_latency.observe(since_last / count)

    def observe_finished(
        self,
        reason: str,
        seconds: float,
        first_token_s: float | None,
        prompt_tokens: int,
        generated: int,
        engine_s: tuple[float, float] | None,
    ) -> None:
        """A request ended with `reason` after `seconds` (its first token after `first_token_s`);
        `engine_s`: its queue and prefill seconds as the engine measured them (None: none came)."""
        counter = self._finished.get(reason)
        if counter is None:  # a reason vLLM does not have: its own series
            counter = self._finished[reason] = self._finished_family.labels(
                self.model_name, ENGINE, reason
            )
        counter.inc()
        self.e2e_latency.observe(seconds)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        if first_token_s is not None:
            decode = seconds - first_token_s
            self.decode_time.observe(decode)
            self.time_per_output_token.observe(decode / (generated - 1) if generated > 1 else 0.0)
        if engine_s is not None:
            queue_s, prefill_s = engine_s
            self.queue_time.observe(queue_s)
            self.prefill_time.observe(prefill_s)
            if first_token_s is not None:
                self.inference_time.observe(prefill_s + seconds - first_token_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
