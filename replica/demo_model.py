"""The demo model: a random-weight Llama and a byte-level BPE tokenizer, built offline.

No model can be downloaded on the machines this project runs on, so the default cluster serves a
model generated locally, deterministically, in seconds: the tokenizer is trained on a fixed list
of the Python standard library's own sources, the weights come from a seeded initialisation.
Its output is random text; its prefill, KV cache and prefix caching are real.

``prefixmesh make-demo-model --out DIR [--size tiny|small]``
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prefixmesh.cli_help import command_parser

if TYPE_CHECKING:
    from prefixmesh.config import PrefixmeshConfig

DemoSize = Literal["tiny", "small"]
FORMAT_VERSION = 1
VOCAB_SIZE = 8192
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Sorted, fixed corpus: the same files (and so the same tokenizer) on every machine with the
# same Python minor version.
CORPUS_PACKAGES = ("json", "email", "asyncio", "concurrent", "logging", "http", "urllib", "xml")


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


SHAPES: dict[str, LlamaShape] = {
    # ~6.6M parameters: a 2,000-token prefill takes ~70 ms on one CPU core (docs/design.md §7).
    "tiny": LlamaShape(256, 512, 4, 4, 2),
    # ~88M parameters: prefill dominated by compute (~650 ms for 2,000 tokens on one core).
    "small": LlamaShape(768, 2048, 12, 12, 4),
}


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for package in CORPUS_PACKAGES:
        files += sorted((stdlib / package).rglob("*.py"))
    if not files:
        raise RuntimeError(f"no corpus found under {stdlib}")
    return files


def _train_tokenizer(out: Path, files: list[Path]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    bos = SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_model(out: Path, shape: LlamaShape, seed: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # ``torch_dtype``: PreTrainedConfig takes it from **kwargs; LlamaConfig's signature omits it.
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **asdict(shape),
    )
    torch.manual_seed(seed)
    # An unannotated __init__; ``to`` is a ``functools.wraps`` wrapper, which typeshed does not
    # bind as a method (it takes the dtype for ``self``).
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def make_demo_model(out: Path, size: DemoSize = "tiny", seed: int = 0) -> Path:
    """Build the demo model into ``out`` (written to a temporary folder, then renamed, so a
    half-written model is never used)."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = corpus_files()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as scratch:
        work = Path(scratch) / "model"
        work.mkdir()
        _train_tokenizer(work, files)
        num_params = _write_model(work, SHAPES[size], seed)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.read_bytes())
        manifest = {
            "format_version": FORMAT_VERSION,
            "size": size,
            "seed": seed,
            "num_parameters": num_params,
            "corpus_sha256": digest.hexdigest(),
            "corpus_files": len(files),
        }
        (work / "prefixmesh-demo.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            raise FileExistsError(f"{out} already exists")
        os.replace(work, out)
    return out


def ensure_demo_model(cache_dir: Path, size: DemoSize = "tiny") -> Path:
    """The demo model in ``cache_dir``, generated on first use."""
    path = Path(cache_dir) / f"demo-{size}-v{FORMAT_VERSION}"
    if not (path / "prefixmesh-demo.json").exists():
        with contextlib.suppress(FileExistsError):  # another process finished it first
            make_demo_model(path, size)
    return path


def resolve_model_path(config: PrefixmeshConfig) -> str:
    """The model folder replicas load: ``replica.model_path``, else the demo model (generated
    into the cache folder on first use)."""
    if config.replica.model_path:
        return config.replica.model_path
    cache = Path(config.cache_dir).expanduser()
    return str(ensure_demo_model(cache / "models", config.replica.demo_model_size))


def main(argv: list[str], prog: str = "make-demo-model") -> int:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder to create")
    parser.add_argument(
        "--size", choices=sorted(SHAPES), default="tiny", help="tiny: ~6.6M parameters; small: ~88M"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    path = make_demo_model(args.out, args.size, args.seed)
    print(json.loads((path / "prefixmesh-demo.json").read_text()))
    return 0
