"""A Serve ingress deployment's FastAPI app in-process, without Ray: its routes, exception
handlers and middleware as ``@serve.ingress`` left them, bound to an instance the test built
through the deployment's own constructor with fakes (``build``), or to any object with the
attributes its routes read (``serve_as``: the direct path's replica, whose routes call its
``DirectFront``).

``serve.ingress`` rewrites the class's routes to take ``self`` from
``serve.get_replica_context().servable_object``; ``serve_as`` answers that with the test's
instance.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes.tokenizer import tiny_tokenizer


def user_class(deployment: type) -> type:
    """The class under ``@serve.ingress``'s wrapper (whose ``__del__`` wants Serve's loop)."""
    return deployment.__mro__[1]


def serve_as(monkeypatch: pytest.MonkeyPatch, instance: Any) -> Any:
    """Make ``instance`` the one its class's app routes run on; returns it."""
    from ray import serve

    context = SimpleNamespace(servable_object=instance)
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    return instance


def build(monkeypatch: pytest.MonkeyPatch, deployment: type, *args: Any) -> Any:
    """An instance of ``deployment``'s own class made by its constructor with ``args`` (as
    Serve would call it), as the one its app's routes run on."""
    return serve_as(monkeypatch, user_class(deployment)(*args))


def spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """Record every call of ``owner.name`` (a function of a module, or a method of an
    instance), which still runs: the list of their positional arguments."""
    original = getattr(owner, name)
    calls: list[tuple[Any, ...]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def spy_global(monkeypatch: pytest.MonkeyPatch, caller: Any, name: str) -> list[tuple[Any, ...]]:
    """``spy`` on the global ``name`` as the function ``caller`` sees it: Serve's ingress
    decorator leaves a deployment class's methods with a copy of their module's globals, so
    patching the module does not reach them."""
    namespace = caller.__globals__
    original = namespace[name]
    calls: list[tuple[Any, ...]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setitem(namespace, name, recorded)
    return calls


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def fast_tokenizer(folder: Path) -> Any:
    """``tests/fakes/tokenizer.py``'s tokenizer as transformers loads a model's, with a chat
    template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_tokenizer(folder) / "tokenizer.json"), eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_folder(folder: Path) -> Path:
    """``fast_tokenizer`` saved as a model folder, which ``AutoTokenizer.from_pretrained``
    loads as a server's constructor does."""
    fast_tokenizer(folder).save_pretrained(folder / "model")
    return folder / "model"
