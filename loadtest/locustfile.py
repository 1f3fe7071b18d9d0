"""prefixmesh's locustfile: OpenAI-API load with open-loop arrivals from the shared workloads.

One scheduler (a single locust user) plays a plan: the simulator's workloads (blog, groups,
multiturn, burst; Poisson arrivals at ``--pm-rate``) or a Mooncake / Qwen-Bailian trace (its own
timestamps, or rescaled to ``--pm-rate``). Each request is spawned on its own greenlet when it is
due, whether or not earlier ones have finished (locust's ``wait_time`` is closed loop, so it is
not used); a multi-turn session's next turn follows its previous turn's end by the think time.
Requests stream (completions or chat); TTFT, inter-token latency (ITL) and end-to-end latency
appear in locust's statistics as request types ``TTFT`` and ``ITL`` next to the ``POST`` rows
(for ``TTFT`` rows the size column is prompt tokens, for ``ITL`` completion tokens); prompt and
cached tokens, the hit rate and the schedule drift are on the web UI's ``/prefixmesh`` page and in
the report.

Headless, bounded, with a report: ``prefixmesh loadtest`` (it runs this file in its own
process: locust and Ray cannot share one). Interactive, with the web UI on loopback:

    locust -f loadtest/locustfile.py --web-host 127.0.0.1 --host http://127.0.0.1:8000 \\
        --pm-workload groups --pm-rate 10 --pm-duration 60

then press start (the user count does not matter: one scheduler plays the plan).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import gevent
from gevent.pool import Group
from geventhttpclient import HTTPClient
from geventhttpclient.url import URL
from locust import User, events, task
from locust.exception import StopUser

from prefixmesh.api.word_vocabulary import Vocabulary
from prefixmesh.loadtest.plan import (
    BodySettings,
    PlanSettings,
    RequestBuilder,
    build_plan,
    parse_params,
    roots_and_followers,
)
from prefixmesh.loadtest.poisson import Launch, OpenLoopScheduler
from prefixmesh.loadtest.prompts import PromptRenderer
from prefixmesh.loadtest.report import (
    ClientRecord,
    LiveSummary,
    prefix_cache_counters,
    write_report,
)
from prefixmesh.loadtest.sse import StreamResult, read_stream
from prefixmesh.loadtest.workloads import WorkloadRequest

LIVE = LiveSummary()


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    ui = {"include_in_web_ui": True}
    parser.add_argument("--pm-workload", default="groups", help="blog|groups|multiturn|burst", **ui)
    parser.add_argument("--pm-trace", default="", help="Mooncake or Qwen-Bailian JSONL", **ui)
    parser.add_argument("--pm-trace-format", default="auto", help="auto|mooncake|qwen", **ui)
    parser.add_argument(
        "--pm-params", default="", help="workload fields, k=v,k=v (system_prompt_tokens=4096)", **ui
    )
    parser.add_argument(
        "--pm-rate", type=float, default=0.0, help="arrivals/s (trace: 0 = its own)", **ui
    )
    parser.add_argument("--pm-duration", type=float, default=60.0, help="arrival window, s", **ui)
    parser.add_argument("--pm-requests", type=int, default=100_000, help="at most this many", **ui)
    parser.add_argument("--pm-seed", type=int, default=0, **ui)
    parser.add_argument("--pm-api", default="completions", help="completions|chat", **ui)
    parser.add_argument("--pm-prompt-format", default="text", help="text|tokens", **ui)
    parser.add_argument("--pm-model", default="demo-tiny", **ui)
    parser.add_argument("--pm-max-tokens", type=int, default=0, help="cap on output tokens", **ui)
    parser.add_argument(
        "--pm-tokenizer", default="", help="tokenizer folder (default: the demo model's)"
    )
    parser.add_argument(
        "--pm-connections", default="fresh", help="fresh (one per request) | reuse", **ui
    )
    parser.add_argument("--pm-drain", type=float, default=60.0, help="wait for in-flight, s")
    parser.add_argument("--pm-timeout", type=float, default=300.0, help="per request, s")
    parser.add_argument("--pm-max-inflight", type=int, default=5000)
    parser.add_argument("--pm-metrics-urls", default="", help="replicas' /metrics, comma list")
    parser.add_argument("--pm-report-dir", default="", help="write the report here at the end")
    parser.add_argument(
        "--pm-quit-after",
        type=float,
        default=-1.0,
        help="quit locust this many seconds after the plan ends (-1: headless only, at once)",
    )


def _vocabulary(folder: str) -> Vocabulary:
    if not folder:
        from prefixmesh.app import resolve_model_path
        from prefixmesh.config import load_config

        folder = resolve_model_path(load_config())
    return Vocabulary.from_tokenizer_dir(folder)


def _params(text: str) -> dict[str, Any]:
    return parse_params(filter(None, (p.strip() for p in text.split(","))))


def plan_settings(options: Any) -> PlanSettings:
    trace = options.pm_trace or None
    return PlanSettings(
        workload=None if trace else options.pm_workload,
        trace=trace,
        trace_format=None if options.pm_trace_format == "auto" else options.pm_trace_format,
        params=_params(options.pm_params),
        rate=options.pm_rate or None,
        requests=options.pm_requests,
        duration_s=options.pm_duration,
        seed=options.pm_seed,
    )


def _scrape(urls: list[str]) -> dict[str, tuple[float, float]] | None:
    if not urls:
        return None
    found = {}
    for url in urls:
        parsed = URL(url)
        client = HTTPClient.from_url(parsed, connection_timeout=10, network_timeout=30)
        try:
            response = client.get(parsed.request_uri)
            found[url] = prefix_cache_counters(response.read().decode())
        finally:
            client.close()
    return found


class OpenLoopOpenAIUser(User):
    """Plays the whole plan; see the module docstring."""

    fixed_count = 1

    @task
    def play(self) -> None:
        options = self.environment.parsed_options
        settings = plan_settings(options)
        vocabulary = _vocabulary(options.pm_tokenizer)
        body_settings = BodySettings(
            api=options.pm_api,
            prompt_format=options.pm_prompt_format,
            model=options.pm_model,
            chat_layout=settings.chat_layout,
            max_tokens_cap=options.pm_max_tokens or None,
        )
        builder = RequestBuilder(PromptRenderer(vocabulary), body_settings)
        requests = build_plan(settings)
        roots, self._followers = roots_and_followers(requests)
        metrics_urls = [u for u in options.pm_metrics_urls.split(",") if u]
        before = _scrape(metrics_urls)

        self._builder = builder
        self._group = Group()
        self._records: list[ClientRecord] = []
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if options.pm_connections == "fresh":
            # A new connection per request: sglang-router holds the first event of a stream
            # ~40 ms on a reused connection (feasibility-peers.md); every router gets the same.
            headers["Connection"] = "close"
        self._headers = headers
        self._client = HTTPClient.from_url(
            URL(self.host),
            concurrency=options.pm_max_inflight,
            connection_timeout=30,
            network_timeout=options.pm_timeout,
        )
        LIVE.reset(len(requests))
        payloads: dict[int, bytes] = {}

        def prepare(index: int) -> None:
            payloads[index] = builder.payload(roots[index])

        def launch(index: int, start: float) -> None:
            if len(self._group) >= options.pm_max_inflight:
                LIVE.dropped += 1
                self._records.append(ClientRecord.dropped(roots[index], roots[index].arrival_s))
                return
            payload = payloads.pop(index)
            self._group.spawn(self._send, roots[index], payload, roots[index].arrival_s, start)

        # The plan and the tokenizer tables live for the whole run: take them out of the
        # collector's view, and collect young objects less often (fewer pauses in the loop).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 50, 100)
        self._start = time.perf_counter()
        scheduler = OpenLoopScheduler(time.perf_counter, gevent.sleep)
        try:
            launches = scheduler.run(
                [r.arrival_s for r in roots], launch, prepare=prepare, until_s=settings.duration_s
            )
            self._group.join(timeout=options.pm_drain)
            unfinished = len(self._group)
            self._group.kill(block=True, timeout=5)
        finally:
            self._client.close()
        after = _scrape(metrics_urls)
        if options.pm_report_dir:
            meta = {
                "target": self.host,
                "plan": {
                    **{k: v for k, v in vars(settings).items() if k != "params"},
                    "params": dict(settings.params),
                },
                "api": options.pm_api,
                "prompt_format": options.pm_prompt_format,
                "connections": options.pm_connections,
                "planned_requests": len(requests),
                "unfinished_at_drain": unfinished,
            }
            write_report(
                Path(options.pm_report_dir),
                self._records,
                _launch_rows(launches),
                meta,
                before,
                after,
            )
        quit_after = 0.0 if options.headless else options.pm_quit_after
        if quit_after >= 0:
            # from a greenlet of its own: quitting the runner kills this user's greenlet
            gevent.spawn(_quit_later, self.environment, quit_after)
        raise StopUser()

    def _send(
        self, request: WorkloadRequest, payload: bytes, scheduled_s: float, start: float
    ) -> None:
        sent_s = time.perf_counter() - start
        began = time.perf_counter()
        replica = ""
        try:
            response = self._client.post(self._builder.path, body=payload, headers=self._headers)
        except Exception as exc:  # connection refused, timeout: a failure, the run goes on
            result = StreamResult(error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            replica = str(response.get("x-prefixmesh-replica") or "")
            if response.status_code != 200:
                text = response.read().decode(errors="replace")[:300]
                result = StreamResult(status=response.status_code, error=text)
            else:
                try:
                    result = read_stream(lambda: response.readline(b"\n"), began, time.perf_counter)
                except Exception as exc:
                    result = StreamResult(status=200, error=f"{type(exc).__name__}: {exc}"[:300])
            response.release()
        record = ClientRecord.from_result(
            request, result, scheduled_s, sent_s, time.perf_counter() - start, replica
        )
        self._records.append(record)
        LIVE.add(record)
        self._fire(result)
        for follower in self._followers.get(request.request_id, ()):
            due = record.end_s + follower.think_s
            payload = self._builder.payload(follower)
            delay = max(0.0, start + due - time.perf_counter())
            self._group.add(gevent.spawn_later(delay, self._send, follower, payload, due, start))

    def _fire(self, result: StreamResult) -> None:
        fire = self.environment.events.request.fire
        name = self._builder.path
        error = Exception(result.error or f"HTTP {result.status}") if not result.ok else None
        fire(
            request_type="POST",
            name=name,
            response_time=result.e2e_s * 1000,
            response_length=result.bytes_read,
            exception=error,
            context={},
        )
        if result.ttft_s is not None:
            fire(
                request_type="TTFT",
                name=name,
                response_time=result.ttft_s * 1000,
                response_length=result.prompt_tokens,
                exception=None,
                context={},
            )
        gaps = result.itl_s
        if gaps:
            fire(
                request_type="ITL",
                name=name,
                response_time=sum(gaps) / len(gaps) * 1000,
                response_length=result.completion_tokens,
                exception=None,
                context={},
            )


def _quit_later(environment: Any, delay_s: float) -> None:
    gevent.sleep(delay_s)  # the web UI shows the final numbers meanwhile
    if environment.runner is not None:
        environment.runner.quit()
    web = getattr(environment, "web_ui", None)
    if web is not None:
        web.stop()


def _launch_rows(launches: list[Launch]) -> list[tuple[float, float]]:
    return [(launch.scheduled_s, launch.launched_s) for launch in launches]


@events.init.add_listener
def _web_page(environment: Any, **_: Any) -> None:
    web = getattr(environment, "web_ui", None)
    if web is None:
        return

    @web.app.route("/prefixmesh")
    def prefixmesh_page() -> Any:
        return web.app.response_class(
            json.dumps(LIVE.snapshot(), indent=2), mimetype="application/json"
        )
