"""The cluster load source against a stand-in Prometheus on loopback that answers the planner's
PromQL queries from a table: the exact queries, the observation worked out from the answers,
and the errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from planner.prometheus import PrometheusError, PrometheusSource


def vector(*samples: tuple[dict, float]) -> list[dict]:
    return [{"metric": labels, "value": [1_700_000_000.0, str(value)]} for labels, value in samples]


ANSWERS = {
    "sum(increase(pdserve_router_ttft_seconds_count[60s]))": vector(({}, 120.0)),
    "sum(increase(pdserve_router_ttft_seconds_sum[60s]))": vector(({}, 30.0)),
    "sum(increase(pdserve_router_inter_token_latency_seconds_count[60s]))": vector(({}, 4000.0)),
    "sum(increase(pdserve_router_inter_token_latency_seconds_sum[60s]))": vector(({}, 100.0)),
    "sum(increase(pdserve_prefill_prompt_tokens_total[60s]))": vector(({}, 48000.0)),
    "sum(increase(pdserve_decode_output_tokens_total[60s]))": vector(({}, 24000.0)),
    "avg(pdserve_decode_running_requests)": vector(({}, 12.5)),
    "(sum(pdserve_router_queued_prompt_tokens) or vector(0)) + "
    "(sum(pdserve_prefill_queued_tokens) or vector(0))": vector(({}, 9000.0)),
    "(sum(rate(pdserve_prefill_prompt_tokens_total[60s])) or vector(0)) + "
    "(sum(deriv(pdserve_router_queued_prompt_tokens[60s])) or vector(0)) + "
    "(sum(deriv(pdserve_prefill_queued_tokens[60s])) or vector(0))": vector(({}, 1300.0)),
    "sum by (pod) (pdserve_decode_running_requests)": vector(
        ({"pod": "d-0"}, 3.0), ({"pod": "d-1"}, 0.0)
    ),  # fmt: skip
}


@pytest.fixture
def prometheus() -> Iterator[dict]:
    state: dict = {"queries": [], "answers": dict(ANSWERS), "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            (query,) = parse_qs(url.query)["query"]
            state["queries"].append((url.path, query))
            ok = state["status"] == 200
            body = ({"status": "success", "data": {"resultType": "vector",
                                                    "result": state["answers"].get(query, [])}}
                    if ok else {"status": "error", "error": "query timed out"})  # fmt: skip
            data = json.dumps(body).encode()
            self.send_response(state["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def test_observation_from_the_interval_queries(prometheus):
    obs = PrometheusSource(prometheus["url"], 60.0).observe()
    assert [path for path, _ in prometheus["queries"]] == ["/api/v1/query"] * 8
    assert [q for _, q in prometheus["queries"]] == list(ANSWERS)[:8]
    assert (obs.interval_s, obs.num_requests, obs.request_rate) == (60.0, 120, 2.0)
    assert (obs.prompt_tokens, obs.output_tokens) == (400.0, 200.0)
    assert (obs.ttft_s, obs.itl_s, obs.decode_batch_per_worker) == (0.25, 0.025, 12.5)
    assert obs.queued_prompt_tokens == 9000.0
    assert obs.slo_attainment is None  # not observable from histograms


def test_no_traffic_yet_is_an_empty_interval(prometheus):
    prometheus["answers"] = {}
    obs = PrometheusSource(prometheus["url"], 60.0).observe()
    assert (obs.num_requests, obs.prompt_tokens, obs.ttft_s, obs.itl_s) == (0, 0.0, None, None)
    assert obs.queued_prompt_tokens == 0.0


def test_the_prefill_flow_is_the_backlog_and_the_arriving_prompt_tokens(prometheus):
    # Arriving: prefilled tokens/s plus the router's and the workers' queues' slopes.
    flow = PrometheusSource(prometheus["url"], 60.0).prefill_flow()
    assert [q for _, q in prometheus["queries"]] == list(ANSWERS)[7:9]
    assert (flow.queued_prompt_tokens, flow.arriving_tokens_per_s) == (9000.0, 1300.0)


def test_pod_loads_by_pod_label(prometheus):
    source = PrometheusSource(prometheus["url"], 60.0)
    assert source.pod_loads("decode") == {"d-0": 3.0, "d-1": 0.0}


def test_an_error_answer_names_the_query(prometheus):
    prometheus["status"] = 503
    with pytest.raises(PrometheusError, match=r"ttft_seconds_count\[60s\]\)\): HTTP 503 query"):
        PrometheusSource(prometheus["url"], 60.0).observe()


def test_an_unreachable_server_is_a_prometheus_error(prometheus):
    with pytest.raises(PrometheusError, match="127.0.0.1:9: sum"):
        PrometheusSource("http://127.0.0.1:9", 60.0).observe()
