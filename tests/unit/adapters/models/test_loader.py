"""Weight loading: packed projections, tied heads, stacked experts, dtype conversion, sharded
and indexed checkpoints, and every refusal (shapes checked before tensor-parallel narrowing,
non-float and duplicated tensors, damaged files)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedinfer.adapters.attention.torch_ref import TorchAttentionBackend
from pagedinfer.adapters.distributed.parallel import SINGLE_PROCESS, ParallelContext
from pagedinfer.adapters.models.base import CausalLM
from pagedinfer.adapters.models.config import ModelConfig
from pagedinfer.adapters.models.loader import load_weights
from pagedinfer.adapters.models.registry import build_model
from pagedinfer.errors import UnsupportedModelError

LAYER0 = "model.layers.0"


def build(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    return build_model(
        ModelConfig.from_pretrained(path),
        parallel=SINGLE_PROCESS,
        backend=TorchAttentionBackend(16),
        device=torch.device("cpu"),
        dtype=dtype,
    )


def expected_parameters(
    tensors: dict[str, torch.Tensor], *, rank: int = 0, world_size: int = 1
) -> dict[str, torch.Tensor]:
    """What each parameter of the model must hold after loading ``tensors`` (a checkpoint's
    Hugging Face names), written from the layout, independently of the loader: q/k/v and
    gate/up projections concatenated row-wise, MoE experts stacked, and under tensor
    parallelism this rank's part (rows of the embedding and of column-parallel projections,
    columns of row-parallel ones; every expert's intermediate features)."""

    def part(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.chunk(world_size, dim)[rank]

    expected: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        stem, _, leaf = name.rpartition(".")
        _, _, proj = stem.rpartition(".")
        if ".mlp.experts." in name:
            owner, _, rest = name.partition(".mlp.experts.")
            index, proj, _ = rest.split(".")
            experts.setdefault(f"{owner}.mlp.experts", {}).setdefault(int(index), {})[proj] = tensor
        elif proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            continue  # concatenated below, in this order
        elif proj in ("o_proj", "down_proj"):
            expected[name] = part(tensor, 1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected[name] = part(tensor, 0)
        else:
            assert (leaf == "weight" and tensor.dim() == 1) or proj == "gate", name
            expected[name] = tensor
    for name in tensors:
        if name.endswith(".self_attn.q_proj.weight"):
            prefix = name.removesuffix(".q_proj.weight")
            expected[f"{prefix}.qkv_proj.weight"] = torch.cat(
                [part(tensors[f"{prefix}.{p}_proj.weight"], 0) for p in "qkv"]
            )
        if name.endswith(".mlp.gate_proj.weight") and ".experts." not in name:
            prefix = name.removesuffix(".gate_proj.weight")
            expected[f"{prefix}.gate_up_proj.weight"] = torch.cat(
                [part(tensors[f"{prefix}.{p}_proj.weight"], 0) for p in ("gate", "up")]
            )
    for prefix, by_index in experts.items():
        order = sorted(by_index)
        assert order == list(range(len(order))), prefix
        expected[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat([part(by_index[e]["gate_proj"], 0), part(by_index[e]["up_proj"], 0)])
                for e in order
            ]
        )
        expected[f"{prefix}.down_proj"] = torch.stack(
            [part(by_index[e]["down_proj"], 1) for e in order]
        )
    return expected


def assert_holds_checkpoint(
    model: CausalLM, tensors: dict[str, torch.Tensor], *, rank: int = 0, world_size: int = 1
) -> None:
    """Every parameter of ``model`` holds exactly its part of ``tensors`` (values, converted
    to the parameter's dtype), and no parameter is left out."""
    params = dict(model.named_parameters())
    expected = expected_parameters(tensors, rank=rank, world_size=world_size)
    if "lm_head.weight" not in params:  # a tied head is the embedding itself
        expected.pop("lm_head.weight", None)
        assert model.get_parameter("lm_head.weight") is params["model.embed_tokens.weight"]
    assert sorted(params) == sorted(expected)
    for name, param in params.items():
        want = expected[name].to(param.dtype)
        assert param.shape == want.shape, name
        assert torch.equal(param, want), name


def edited_copy(
    source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """A copy of checkpoint ``source`` whose tensors went through ``edit``."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def with_distinct_norms(source: Path, target: Path) -> Path:
    """A copy of checkpoint ``source`` whose norm weights are random around 1: a random
    checkpoint's are all ones, which is also what a model's norms hold before loading, so a
    norm that is never loaded would go unseen."""
    generator = torch.Generator().manual_seed(0)

    def vary(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if tensor.dim() == 1:
                noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                tensors[name] = 1.0 + 0.1 * noise

    return edited_copy(source, target, vary)


@pytest.fixture(scope="module")
def tiny_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint (overriding the shared fixture here) with distinct norm weights."""
    target = tmp_path_factory.mktemp("loader") / "tiny"
    path = with_distinct_norms(make_checkpoint("tiny"), target)
    norm = load_file(str(path / "model.safetensors"))[f"{LAYER0}.self_attn.k_norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))
    return path


@pytest.fixture(scope="module")
def moe_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    source = make_checkpoint("tiny", architecture="Qwen3MoeForCausalLM", num_experts=4)
    return with_distinct_norms(source, tmp_path_factory.mktemp("loader") / "moe")


def test_packed_projections_hold_the_checkpoint_tensors(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint)
    load_weights(model, tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    params = dict(model.named_parameters())
    qkv = params[f"{LAYER0}.self_attn.qkv_proj.weight"]
    expected_qkv = torch.cat(
        [tensors[f"{LAYER0}.self_attn.{name}_proj.weight"] for name in ("q", "k", "v")]
    )
    assert torch.equal(qkv, expected_qkv)
    gate_up = params[f"{LAYER0}.mlp.gate_up_proj.weight"]
    expected_gate_up = torch.cat(
        [tensors[f"{LAYER0}.mlp.{name}_proj.weight"] for name in ("gate", "up")]
    )
    assert torch.equal(gate_up, expected_gate_up)
    assert torch.equal(params["model.norm.weight"], tensors["model.norm.weight"])
    assert_holds_checkpoint(model, tensors)


def test_tied_head_shares_the_embedding(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint)
    load_weights(model, tiny_checkpoint)
    head = model.get_parameter("lm_head.weight")
    embedding = model.get_parameter("model.embed_tokens.weight")
    assert head is embedding
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert torch.equal(head, tensors["model.embed_tokens.weight"])


def test_untied_head_loads_its_own_weight(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = with_distinct_norms(make_checkpoint("tiny", tie_word_embeddings=False), tmp_path / "u")
    model = build(path)
    load_weights(model, path)
    tensors = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.get_parameter("lm_head.weight"), tensors["lm_head.weight"])
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert_holds_checkpoint(model, tensors)


def test_tied_checkpoint_that_also_stores_lm_head_loads(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    def add_head(tensors: dict[str, torch.Tensor]) -> None:
        # Not quite the embedding: the model must keep the embedding (tied) and ignore this.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0

    path = edited_copy(tiny_checkpoint, tmp_path / "with-head", add_head)
    model = build(path)
    load_weights(model, path)
    tensors = load_file(str(path / "model.safetensors"))
    assert_holds_checkpoint(model, {k: v for k, v in tensors.items() if k != "lm_head.weight"})


def test_weights_are_converted_to_the_model_dtype(tiny_checkpoint: Path) -> None:
    model = build(tiny_checkpoint, torch.bfloat16)
    load_weights(model, tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    embedding = model.get_parameter("model.embed_tokens.weight")
    assert embedding.dtype is torch.bfloat16
    assert torch.equal(embedding, tensors["model.embed_tokens.weight"].to(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_holds_checkpoint(model, tensors)  # every value, rounded to bfloat16
    # The rotary tables stay float32 whatever the model dtype.
    assert model.get_buffer("model.rotary_emb.cos").dtype is torch.float32


def test_no_safetensors(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "no-weights"
    path.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", path / "config.json")
    with pytest.raises(UnsupportedModelError, match=r"no-weights.*safetensors") as info:
        load_weights(build(path), path)
    assert isinstance(info.value, ValueError)


def test_missing_weight_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = f"{LAYER0}.self_attn.k_proj.weight"

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    path = edited_copy(tiny_checkpoint, tmp_path / "missing", drop)
    with pytest.raises(UnsupportedModelError, match="missing") as info:
        load_weights(build(path), path)
    assert name in str(info.value)


def test_missing_untied_head_is_named(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = make_checkpoint("tiny", tie_word_embeddings=False)

    def drop_head(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["lm_head.weight"]

    path = edited_copy(source, tmp_path / "no-head", drop_head)
    with pytest.raises(UnsupportedModelError, match=r"lm_head\.weight"):
        load_weights(build(path), path)


def test_unknown_weight_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def add_unknown(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{LAYER0}.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    path = edited_copy(tiny_checkpoint, tmp_path / "unknown", add_unknown)
    with pytest.raises(UnsupportedModelError, match="extra_proj") as info:
        load_weights(build(path), path)
    assert "unknown" in str(info.value)  # the checkpoint path


def test_wrong_shape_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = "model.norm.weight"

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:10].clone()

    path = edited_copy(tiny_checkpoint, tmp_path / "shape", shrink)
    with pytest.raises(UnsupportedModelError, match=name):
        load_weights(build(path), path)


# ------------------------------------------------ shapes and dtypes before any TP narrowing


def build_rank(path: Path, rank: int, world_size: int) -> CausalLM:
    """This rank's model of a ``world_size``-way tensor-parallel group (loading needs no
    collectives, so no process group is created)."""
    return build_model(
        ModelConfig.from_pretrained(path),
        parallel=ParallelContext(rank=rank, world_size=world_size),
        backend=TorchAttentionBackend(16),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def grow_rows(name: str, extra: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensor = tensors[name]
        tensors[name] = torch.cat([tensor, torch.zeros(extra, *tensor.shape[1:])])

    return edit


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_holds_its_part(tiny_checkpoint: Path, rank: int) -> None:
    model = build_rank(tiny_checkpoint, rank, 2)
    load_weights(model, tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert_holds_checkpoint(model, tensors, rank=rank, world_size=2)
    # The layout the helper assumes, spelled out for one layer: rank 1 holds the second
    # half of the query heads and the second of the two KV heads.
    qkv = model.get_parameter(f"{LAYER0}.self_attn.qkv_proj.weight")
    q, k, v = (tensors[f"{LAYER0}.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv[:64], q[64 * rank : 64 * (rank + 1)])
    assert torch.equal(qkv[64:96], k[32 * rank : 32 * (rank + 1)])
    assert torch.equal(qkv[96:], v[32 * rank : 32 * (rank + 1)])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("name", "edit", "expected", "actual"),
    [
        # Larger tensors: a TP shard of the first rows would have fitted (and loaded silently).
        (
            f"{LAYER0}.self_attn.q_proj.weight",
            grow_rows(f"{LAYER0}.self_attn.q_proj.weight", 32),
            "[128, 64]",
            "[160, 64]",
        ),
        (
            "model.embed_tokens.weight",
            grow_rows("model.embed_tokens.weight", 2),
            "[512, 64]",
            "[514, 64]",
        ),
        (
            f"{LAYER0}.mlp.down_proj.weight",
            lambda t: t.update(
                {f"{LAYER0}.mlp.down_proj.weight": torch.zeros(64, 256)},
            ),
            "[64, 128]",
            "[64, 256]",
        ),
        # Smaller tensors: once a bare torch error from narrow(), naming nothing.
        (
            f"{LAYER0}.mlp.gate_proj.weight",
            lambda t: t.update({f"{LAYER0}.mlp.gate_proj.weight": torch.zeros(64, 64)}),
            "[128, 64]",
            "[64, 64]",
        ),
        (
            f"{LAYER0}.self_attn.v_proj.weight",
            lambda t: t.update({f"{LAYER0}.self_attn.v_proj.weight": torch.zeros(64)}),
            "[64, 64]",
            "[64]",
        ),
    ],
)
def test_full_shape_is_checked_before_tensor_parallel_narrowing(
    tiny_checkpoint: Path,
    tmp_path: Path,
    world_size: int,
    name: str,
    edit: Callable[[dict[str, torch.Tensor]], None],
    expected: str,
    actual: str,
) -> None:
    path = edited_copy(tiny_checkpoint, tmp_path / "resized", edit)
    for rank in range(world_size):
        with pytest.raises(UnsupportedModelError) as info:
            load_weights(build_rank(path, rank, world_size), path)
        message = str(info.value)
        assert name in message and "model.safetensors" in message and "resized" in message
        assert f"shape {actual}" in message and f"shape {expected}" in message


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.uint8])
def test_integer_and_bool_tensors_are_refused(
    tiny_checkpoint: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    name = "model.norm.weight"

    def cast(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(dtype)

    path = edited_copy(tiny_checkpoint, tmp_path / "ints", cast)
    with pytest.raises(UnsupportedModelError, match="not a floating-point type") as info:
        load_weights(build(path), path)
    assert name in str(info.value)


def test_half_precision_tensors_load_into_a_float32_model(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    def to_half(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].to(torch.float16)

    path = edited_copy(tiny_checkpoint, tmp_path / "half", to_half)
    model = build(path)
    load_weights(model, path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    half = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in half.values()} == {torch.float16}
    assert_holds_checkpoint(model, half)  # the float16 values, exactly, as float32


# ------------------------------------------------------------- files: shards and damage


def shard(source: Path, target: Path, *, index: bool, overlap: bool = False) -> Path:
    """A copy of ``source`` with its tensors split over two files (plus an index file);
    with ``overlap``, the second file repeats one tensor of the first."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    if overlap:
        second = [*second, first[0]]
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(target / file), metadata={"format": "pt"})
    if index:
        weight_map = {key: file for file, keys in files.items() for key in keys}
        (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return target


@pytest.mark.parametrize("index", [True, False])
def test_sharded_checkpoints_load(tiny_checkpoint: Path, tmp_path: Path, index: bool) -> None:
    path = shard(tiny_checkpoint, tmp_path / "sharded", index=index)
    model = build(path)
    load_weights(model, path)
    assert_holds_checkpoint(model, load_file(str(tiny_checkpoint / "model.safetensors")))


def test_a_tensor_stored_twice_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = shard(tiny_checkpoint, tmp_path / "twice", index=False, overlap=True)
    with pytest.raises(UnsupportedModelError, match="stored in") as info:
        load_weights(build(path), path)
    message = str(info.value)
    assert "model-00001-of-00002.safetensors" in message
    assert "model-00002-of-00002.safetensors" in message


def test_the_index_decides_which_files_are_read(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Mistral repositories ship ``consolidated.safetensors`` (another naming scheme) beside
    the indexed Hugging Face shards; it must not be read."""
    path = shard(tiny_checkpoint, tmp_path / "indexed", index=True)
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    model = build(path)
    load_weights(model, path)
    assert_holds_checkpoint(model, load_file(str(tiny_checkpoint / "model.safetensors")))
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(UnsupportedModelError, match="tok_embeddings"):
        load_weights(build(path), path)


def test_an_index_naming_a_missing_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = shard(tiny_checkpoint, tmp_path / "gap", index=True)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=r"model-00002-of-00002\.safetensors"):
        load_weights(build(path), path)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"weight_map": {}}', b"\xff\xfe"])
def test_an_unreadable_index(tiny_checkpoint: Path, tmp_path: Path, content: bytes) -> None:
    path = shard(tiny_checkpoint, tmp_path / "bad-index", index=True)
    (path / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors\.index\.json"):
        load_weights(build(path), path)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: b"not a safetensors file at all", id="garbage"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: (10**9).to_bytes(8, "little") + data[8:], id="bad-header-size"),
    ],
)
def test_corrupt_safetensors_name_the_file(
    tiny_checkpoint: Path, tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    path = tmp_path / "corrupt"
    shutil.copytree(tiny_checkpoint, path)
    weights = path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(UnsupportedModelError) as info:
        load_weights(build(path), path)
    message = str(info.value)
    assert str(weights) in message and "expected a safetensors file" in message


def test_a_symlink_loop_instead_of_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "loop"
    shutil.copytree(tiny_checkpoint, path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors"):
        load_weights(build(path), path)


# ------------------------------------------------------------------------ MoE experts


def test_expert_tensors_are_stacked(moe_checkpoint: Path) -> None:
    path = moe_checkpoint
    model = build(path)
    load_weights(model, path)
    tensors = load_file(str(path / "model.safetensors"))
    experts = f"{LAYER0}.mlp.experts"
    gate_up = model.get_parameter(f"{experts}.gate_up_proj")
    down = model.get_parameter(f"{experts}.down_proj")
    for e in range(4):
        expected = torch.cat(
            [tensors[f"{experts}.{e}.gate_proj.weight"], tensors[f"{experts}.{e}.up_proj.weight"]]
        )
        assert torch.equal(gate_up[e], expected)
        assert torch.equal(down[e], tensors[f"{experts}.{e}.down_proj.weight"])
    assert_holds_checkpoint(model, tensors)


def test_expert_shards_split_the_intermediate_features(moe_checkpoint: Path) -> None:
    path = moe_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    experts = f"{LAYER0}.mlp.experts"
    for rank in range(2):
        model = build_rank(path, rank, 2)
        load_weights(model, path)
        rows = slice(rank * 16, (rank + 1) * 16)  # moe_intermediate_size 32 over 2 ranks
        gate_up = model.get_parameter(f"{experts}.gate_up_proj")
        assert torch.equal(gate_up[3, :16], tensors[f"{experts}.3.gate_proj.weight"][rows])
        assert torch.equal(gate_up[3, 16:], tensors[f"{experts}.3.up_proj.weight"][rows])
        down = model.get_parameter(f"{experts}.down_proj")
        assert torch.equal(down[3], tensors[f"{experts}.3.down_proj.weight"][:, rows])
        assert_holds_checkpoint(model, tensors, rank=rank, world_size=2)


def test_missing_and_unknown_experts_are_named(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = make_checkpoint("tiny", architecture="Qwen3MoeForCausalLM", num_experts=4)
    name = f"{LAYER0}.mlp.experts.2.up_proj.weight"

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    path = edited_copy(source, tmp_path / "no-expert", drop)
    with pytest.raises(UnsupportedModelError, match="missing") as info:
        load_weights(build(path), path)
    assert name in str(info.value)

    extra = f"{LAYER0}.mlp.experts.4.up_proj.weight"  # the config says 4 experts: 0..3

    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors[extra] = tensors[name.replace(".2.", ".1.")].clone()

    path = edited_copy(source, tmp_path / "fifth-expert", add)
    with pytest.raises(UnsupportedModelError, match="matches no parameter") as info:
        load_weights(build(path), path)
    assert extra in str(info.value)
