import asyncio

from prefixmesh.tasks import cancel_and_wait


def test_cancel_and_wait_ends_the_task_and_accepts_none() -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            await asyncio.Event().wait()

        task = asyncio.get_running_loop().create_task(forever())
        await started.wait()
        await cancel_and_wait(task)
        assert task.cancelled()
        await cancel_and_wait(None)

    asyncio.run(main())
