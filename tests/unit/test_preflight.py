"""The preflight's arithmetic: nccl-tests' bus bandwidth, and which node or link it names."""

from __future__ import annotations

import pytest
import torch

from model_utils.parallel import preflight


def test_bus_bandwidth_counts_what_each_rank_sends() -> None:
    # 8 GB gathered by 8 ranks in 1 s: each sends and receives 7/8 of it, 7 GB/s on its link
    assert preflight.bus_gbs(8 * 10**9, 8, 1.0) == pytest.approx(7.0)
    assert preflight.bus_gbs(8 * 10**9, 2, 2.0) == pytest.approx(2.0)


def test_the_largest_unit_counts_a_tied_matrix_once() -> None:
    """Llama 3.2's tied embedding is one FSDP2 unit with the final norm: one matrix gathered,
    not two (the preflight would time twice the bytes a step moves)."""
    from model_utils.config.arguments import parse_args
    from model_utils.model import modeling

    shape = ["--preset=tiny", "--vocab_size=4096", "--hidden_width=256", "--num_layers=1"]
    for tied in (True, False):
        config = parse_args([*shape, f"--tie_word_embeddings={int(tied)}"])
        model = modeling.build(config, "hf", torch.device("meta"))
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert preflight.largest_unit(model) == 4096 * 256 + 256  # the matrix, the final norm


def test_only_what_is_under_half_the_median_is_named() -> None:
    links = {"a -> b": 10.0, "b -> c": 9.0, "c -> d": 4.4, "d -> a": 11.0}
    [line] = preflight.slow_ones(links, "link")
    assert line.startswith("preflight: slow link c -> d: 4.40 GB/s, 0.46x the median link")
    assert preflight.slow_ones({"a -> b": 10.0, "b -> a": 6.0}, "link") == []  # 0.75x: no
    assert preflight.slow_ones({"node-a": 1.0}, "node") == []  # nothing to compare with
    [node] = preflight.slow_ones({"node-a": 20.0, "node-b": 2.0}, "node")
    assert "slow node node-b" in node  # of two, the one under a third of the other


def test_the_record_reads_as_lines_with_the_slow_ones_last() -> None:
    row = dict(op="all_gather", payload="bf16", scope="across nodes", ranks=2, bytes=2**20)
    record = dict(
        form="full",
        backend="gloo",
        nodes=2,
        ranks=2,
        unit_parameters=1234,
        collectives=[row | {"seconds": 0.001, "bus_gbs": 0.52}],
        links={"a -> b": 1.0, "b -> a": 0.1},
        slow=["preflight: slow link b -> a: ..."],
    )
    lines = preflight.summary(record)
    assert lines[0].startswith(
        "preflight (full, gloo, 2 node(s), 2 ranks): largest FSDP unit 1,234"
    )
    assert (
        lines[1] == "preflight: all-gather bf16 1.0 MiB across nodes (2 ranks): 0.52 GB/s, 1.00 ms"
    )
    assert lines[2] == (
        "preflight: links per GPU pair (a node's GPUs each to its peer on the next, at once) "
        "a -> b 1.00, b -> a 0.10"
    )
    assert lines[-1].startswith("preflight: slow link b -> a")
