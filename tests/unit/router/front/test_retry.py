"""Ingress retries with fake generations: which failures are retried, where, and how often."""

from __future__ import annotations

import pytest
import ray.exceptions as ray_errors

from prefixmesh.cache_registry.types import BlockHash, PrefixKey
from prefixmesh.replica.engines.remote_engine import RemoteEngineLost
from prefixmesh.router.front.retry import AttemptFailed, is_retryable, retry_request, run_with_retry
from prefixmesh.wire import GenerateRequest, Hold, RouteTicket, SamplingSettings


class FakeGeneration:
    """An attempt that fails (or not) at its first token or while finishing."""

    def __init__(
        self,
        replica: str,
        fail_first: BaseException | None = None,
        fail_finish: BaseException | None = None,
    ) -> None:
        self.replica = replica
        self.fail_first = fail_first
        self.fail_finish = fail_finish

    async def first(self) -> None:
        if self.fail_first is not None:
            raise self.fail_first


class Starts:
    """Hands out the scripted attempts and records what each start was told to avoid."""

    def __init__(self, *attempts: FakeGeneration) -> None:
        self.attempts = list(attempts)
        self.avoided: list[tuple[str, ...]] = []

    def __call__(self, avoid: tuple[str, ...], attempt: int) -> FakeGeneration:
        assert attempt == len(self.avoided)
        self.avoided.append(avoid)
        return self.attempts.pop(0)


async def finish(generation: FakeGeneration) -> str:
    if generation.fail_finish is not None:
        raise generation.fail_finish
    return f"text from {generation.replica}"


def died() -> BaseException:
    return ray_errors.ActorDiedError()


def remote_engine_broke() -> BaseException:
    # What the ingress sees when the replica's remote engine lost its server: the replica's
    # task raised RemoteEngineLost, wrapped by Ray as an instance of its cause.
    error = ray_errors.RayTaskError("generate", "traceback", RemoteEngineLost("refused"))
    return error.as_instanceof_cause()


async def test_a_failure_before_the_first_token_is_retried_elsewhere() -> None:
    starts = Starts(FakeGeneration("r1", fail_first=died()), FakeGeneration("r2"))
    phases: list[str] = []
    done = await run_with_retry(
        starts,
        finish,
        retries=1,
        replica_of=lambda g: g.replica,
        on_retry=lambda phase, _: phases.append(phase),
    )
    assert done.result == "text from r2"
    assert done.retries == 1
    assert starts.avoided == [(), ("r1",)]
    assert phases == ["before_first_token"]


async def test_a_non_streamed_request_that_fails_mid_generation_starts_again() -> None:
    starts = Starts(FakeGeneration("r1", fail_finish=died()), FakeGeneration("r2"))
    phases: list[str] = []
    done = await run_with_retry(
        starts,
        finish,
        retries=1,
        replica_of=lambda g: g.replica,
        on_retry=lambda phase, _: phases.append(phase),
    )
    assert done.generation.replica == "r2"
    assert starts.avoided == [(), ("r1",)]
    assert phases == ["mid_generation"]


async def test_a_second_failure_is_raised() -> None:
    starts = Starts(
        FakeGeneration("r1", fail_first=died()), FakeGeneration("r2", fail_first=died())
    )
    with pytest.raises(AttemptFailed) as failed:
        await run_with_retry(starts, finish, retries=1, replica_of=lambda g: g.replica)
    assert failed.value.phase == "before_first_token"
    assert failed.value.retries == 1
    assert isinstance(failed.value.cause, ray_errors.ActorDiedError)
    assert starts.avoided == [(), ("r1",)]


async def test_every_failed_replica_is_avoided() -> None:
    starts = Starts(
        FakeGeneration("r1", fail_first=died()),
        FakeGeneration("r2", fail_finish=died()),
        FakeGeneration("r3"),
    )
    done = await run_with_retry(starts, finish, retries=2, replica_of=lambda g: g.replica)
    assert done.retries == 2
    assert starts.avoided == [(), ("r1",), ("r1", "r2")]
    assert done.avoided == ("r1", "r2")


async def test_application_errors_are_not_retried() -> None:
    bad_input = ray_errors.RayTaskError("generate", "tb", ValueError("prompt too long"))
    starts = Starts(FakeGeneration("r1", fail_first=bad_input.as_instanceof_cause()))
    with pytest.raises(AttemptFailed) as failed:
        await run_with_retry(starts, finish, retries=3, replica_of=lambda g: g.replica)
    assert failed.value.retries == 0
    assert isinstance(failed.value.cause, ValueError)
    assert starts.avoided == [()]


async def test_no_retries_configured_means_none() -> None:
    starts = Starts(FakeGeneration("r1", fail_first=died()))
    with pytest.raises(AttemptFailed):
        await run_with_retry(starts, finish, retries=0, replica_of=lambda g: g.replica)
    assert starts.avoided == [()]


async def test_an_unknown_replica_is_not_added_to_the_avoid_list() -> None:
    starts = Starts(FakeGeneration("", fail_first=died()), FakeGeneration("r2"))
    await run_with_retry(starts, finish, retries=1, replica_of=lambda g: g.replica)
    assert starts.avoided == [(), ()]


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        (ray_errors.ActorDiedError(), True),
        (ray_errors.ActorUnavailableError("gone", None), True),
        (ray_errors.RayActorError(), True),
        (ray_errors.WorkerCrashedError(), True),
        (remote_engine_broke(), True),
        (
            ray_errors.RayTaskError(
                "generate", "tb", ConnectionResetError("server disconnected")
            ).as_instanceof_cause(),
            True,
        ),
        (  # a slow remote server is not a dead one
            ray_errors.RayTaskError("generate", "tb", TimeoutError("slow")).as_instanceof_cause(),
            False,
        ),
        (
            ray_errors.RayTaskError("generate", "tb", RuntimeError("500")).as_instanceof_cause(),
            False,
        ),
        (ValueError("bad"), False),
        (TimeoutError(), False),
    ],
)
def test_which_failures_are_retryable(error: BaseException, retryable: bool) -> None:
    assert is_retryable(error) is retryable


def test_a_retry_request_carries_no_decision_of_the_failed_attempt() -> None:
    # A hold copied into the retry would make it wait for the dead replica's prefill
    # somewhere else (regression).
    key = PrefixKey((BlockHash(11),), 2)
    decided = RouteTicket("req-1", "r1", "prefixmesh", 1, hold=Hold(num_blocks=1, max_wait_s=0.5))
    parent = {"traceparent": "00-ab-cd-01"}  # the request span's: the retry's parent too
    first = GenerateRequest(
        "req-1", (1, 2, 3), key, SamplingSettings(4), ticket=decided, trace_context=parent
    )
    retry = retry_request(first, 1, ("r1",))
    assert retry.request_id == "req-1-retry1"
    assert retry.avoid_replicas == ("r1",)
    assert (retry.ticket, retry.hold) == (None, None)
    assert retry.trace_context == {"traceparent": "00-ab-cd-01"}
    assert (retry.prompt_token_ids, retry.key, retry.sampling) == (
        first.prompt_token_ids,
        key,
        first.sampling,
    )
