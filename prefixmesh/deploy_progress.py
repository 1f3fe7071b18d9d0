"""What ``prefixmesh serve`` prints while Serve starts the replicas: each deployment's running
and starting replicas every few seconds, so a minute of vLLM engines loading is not a minute
of silence (issue 38). ``progress_line`` is pure (Serve's status in, one line out);
``run_with_progress`` runs ``serve.run`` in a thread and prints it meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

PROGRESS_EVERY_S = 10.0


def progress_line(deployments: Mapping[str, Any], elapsed_s: float) -> str:
    """``deployments``: Serve's ``DeploymentStatusOverview`` by name (``replica_states``
    counts replicas by state)."""
    parts = []
    for name, status in sorted(deployments.items()):
        states = {str(getattr(k, "value", k)): n for k, n in status.replica_states.items()}
        running = states.pop("RUNNING", 0)
        total = running + sum(states.values())
        others = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()) if n)
        parts.append(f"{name} {running}/{total} running" + (f" ({others})" if others else ""))
    summary = "; ".join(parts) if parts else "no deployment yet"
    return f"  ... {elapsed_s:.0f} s: {summary}"


def run_with_progress(
    run: Callable[[], Any],
    deployments: Callable[[], Mapping[str, Any]],
    say: Callable[[str], None],
    every_s: float = PROGRESS_EVERY_S,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """``run()``'s result (``serve.run``, which returns once every replica is ready), saying
    ``progress_line(deployments())`` every ``every_s`` meanwhile; ``run``'s exception is
    raised here."""
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # raised in the caller's thread below
            failure.append(exc)

    started = clock()
    thread = threading.Thread(target=target, name="serve-run", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(every_s)
        if thread.is_alive():
            try:
                say(progress_line(deployments(), clock() - started))
            except Exception as exc:  # a status read that failed: say so, keep waiting
                say(f"  ... {clock() - started:.0f} s: status unavailable ({exc})")
    if failure:
        raise failure[0]
    return outcome[0] if outcome else None
