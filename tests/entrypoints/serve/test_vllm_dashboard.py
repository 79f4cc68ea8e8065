"""vLLM's published Grafana dashboard against a running CPU `spmoe serve` (TP 2, gloo): every series
its queries read (tests/entrypoints/serve/vllm_grafana_series.txt) is in /metrics under vLLM's name,
with the labels the queries select or group by, and the model_name the dashboard's variable
lists."""

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.serve.test_serve import checkpoint, start_server  # noqa: F401 (a fixture)

SERIES = Path(__file__).with_name("vllm_grafana_series.txt")


def dashboard_series() -> list[tuple[str, tuple[str, ...]]]:
    rows = []
    for line in SERIES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *labels = line.split()
            rows.append((name, tuple(labels)))
    return rows


@pytest.fixture(scope="module")
def served_metrics(checkpoint, tmp_path_factory) -> str:  # noqa: F811
    """/metrics of a real server after one completion and one streamed chat."""
    log = tmp_path_factory.mktemp("dashboard_log") / "stderr.txt"
    proc, base = start_server(checkpoint, log)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
        chunks = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
        )
        assert list(chunks)
        yield httpx.get(base + "/metrics", timeout=30).text
    finally:
        proc.kill()
        proc.wait()


def test_the_dashboard_reads_every_series(served_metrics):
    samples = [
        sample
        for family in text_string_to_metric_families(served_metrics)
        for sample in family.samples
    ]
    rows = dashboard_series()
    assert len(rows) == 21 and all(name.startswith("vllm:") for name, _ in rows)
    for name, labels in rows:
        found = [s for s in samples if s.name == name and set(labels) <= set(s.labels)]
        assert {s.labels["model_name"] for s in found} == {"tiny"}, name
    value = {
        s.name: s.value
        for s in samples
        if "le" not in s.labels and "finished_reason" not in s.labels
    }
    assert value["vllm:e2e_request_latency_seconds_count"] == 2
    assert value["vllm:generation_tokens_total"] >= 5  # the completion ran to max_tokens
    assert value["vllm:request_max_num_generation_tokens_sum"] == 5 + 3
    for timed in ("queue", "prefill", "inference"):  # from the engine's first outputs
        assert value[f"vllm:request_{timed}_time_seconds_count"] == 2, timed
    assert value["vllm:request_prefill_time_seconds_sum"] > 0
    assert (
        value["vllm:request_inference_time_seconds_sum"]
        >= value["vllm:request_prefill_time_seconds_sum"]
    )
    success = sum(s.value for s in samples if s.name == "vllm:request_success_total")
    assert success == 2
    assert not [s.name for s in samples if s.name.startswith("spmoe:num_requests")]
