"""analysis/project_scale.py: the projection of a measured pair to N nodes reproduces published
multi-node runs within its stated tolerance, moves with the links as FSDP2's collectives do, and
reads a pair of run folders as the command a user runs."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from analysis import project_scale as ps
from model_utils.config.arguments import parse_args
from model_utils.report import metrics


@pytest.mark.parametrize("ref", ps.REFERENCES, ids=lambda ref: ref.name)
def test_the_projection_reproduces_each_published_multi_node_run(ref: ps.Reference) -> None:
    """From the smaller scale's published tokens/s to the larger one's, within TOLERANCE."""
    got = ps.projected(ref.job, ref.base, *ref.at)
    assert abs(got / ref.published - 1) <= ps.TOLERANCE, (ref.name, got, ref.published)


def test_exposed_communication_follows_the_links_and_fp8_needs_more_tokens_to_hide_it() -> None:
    """One node hides all but its edges; a slow network exposes every layer's collectives, and
    more for FP8 (its faster compute hides less), which the float8 all-gather partly wins back;
    hybrid sharding keeps the gathers in the node."""
    bf16 = ps.Job(embedding=100e6, layer=50e6, layers=16, tokens_per_gpu=8192, tokens_per_sec=9e3)
    fp8 = dataclasses.replace(bf16, tokens_per_sec=12e3)
    fp8_ag = dataclasses.replace(fp8, gather_bytes=1.0)
    slow = ps.Links(network=5.0)
    node, far = ps.exposed_seconds(bf16, 1, 8), ps.exposed_seconds(bf16, 16, 8, links=slow)
    assert 0 < node < far
    ratio = {
        n: ps.projected(fp8, (1, 1), n, 8, links=slow)
        / ps.projected(bf16, (1, 1), n, 8, links=slow)
        for n in (1, 16)
    }
    assert ratio[16] < ratio[1] == pytest.approx(12 / 9, rel=0.02)
    assert ps.projected(fp8_ag, (1, 1), 16, 8, links=slow) > ps.projected(
        fp8, (1, 1), 16, 8, links=slow
    )
    hybrid = ps.exposed_seconds(bf16, 16, 8, hybrid=True, links=slow)
    assert hybrid < far


def test_an_fp8_reduce_moves_a_quarter_of_the_bytes_inside_the_shard_group_only() -> None:
    """--reduce_dtype: fp8's reduce-scatter exposes less than bf16's, bf16's less than fp32's;
    under hybrid sharding the all-reduce across nodes stays fp32 with fp8, so it gains only
    inside the node there."""
    job = ps.Job(embedding=100e6, layer=50e6, layers=16, tokens_per_gpu=8192, tokens_per_sec=12e3)
    slow = ps.Links(network=5.0)
    exposed = {
        (reduce, hybrid): ps.exposed_seconds(
            dataclasses.replace(job, reduce=reduce), 16, 8, hybrid=hybrid, links=slow
        )
        for reduce in ps.REDUCE_BYTES
        for hybrid in (False, True)
    }
    assert exposed["fp8", False] < exposed["bf16", False] < exposed["fp32", False]
    # hybrid over a slow network: the fp32 all-reduce across nodes dominates, which bf16 halves
    assert exposed["bf16", True] < exposed["fp8", True] < exposed["fp32", True]
    assert ps.REDUCE_BYTES["fp8"] == (1 + 4 / 128, 4.0)


def _run(folder: Path, fp8: bool, tokens_per_sec: float) -> str:
    flags = parse_args(["--preset", "tiny", f"--fp8={int(fp8)}"]).as_dict()
    with metrics.JsonlWriter(folder / "metrics.jsonl") as writer:
        writer.write(metrics.run_record(flags, world_size=1, samples_per_step=8))
        for step in range(1, 21):
            writer.write(
                {
                    "kind": "train",
                    "step": step,
                    "loss": 9.0,
                    "lr": 1e-3,
                    "samples_per_sec": 1.0,
                    "tokens_per_sec_per_device": tokens_per_sec,
                }
            )
    return str(folder)


def test_the_command_reads_a_pair_and_prints_each_scale(tmp_path, capsys) -> None:
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    assert ps.main([*pair, "--nodes", "4,1,4", "--gpus_per_node", "8"]) == 0  # sorted, once
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:4] for line in out[1:-1]] == [
        ["1", "x", "8", "full"],
        ["4", "x", "8", "full"],
        ["4", "x", "8", "hybrid"],
    ]
    assert out[-1].startswith("links: 360 GB/s in a node (assumed: --node_gbs's default)")
    assert out[1].split()[6] == "1.200"  # one node of a tiny model: FP8's measured ratio
    assert ps.main([*pair, "--nodes", "4", "--reduce_dtype", "fp8"]) == 0
    fp8_reduce = capsys.readouterr().out
    assert fp8_reduce.splitlines()[1].split()[:4] == ["4", "x", "8", "full"]
    for run in pair:  # a pair trained with --reduce_dtype fp8 is projected with it unasked
        lines = (Path(run) / "metrics.jsonl").read_text()
        (Path(run) / "metrics.jsonl").write_text(
            lines.replace('"reduce_dtype": "fp32"', '"reduce_dtype": "fp8"')
        )
    assert ps.main([*pair, "--nodes", "4"]) == 0
    assert capsys.readouterr().out == fp8_reduce
    with pytest.raises(SystemExit) as bad:
        ps.main([*pair, "--nodes", "two"])
    assert bad.value.code == 2 and "--nodes takes node counts" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as missing:
        ps.main([pair[0], str(tmp_path / "empty")])
    assert (
        missing.value.code == 2 and "empty/metrics.jsonl: no such file" in capsys.readouterr().err
    )


def test_a_pair_out_of_order_unlike_or_with_odd_links_is_one_line(tmp_path, capsys) -> None:
    """BF16 first, FP8 second, of one model and batch; finite, positive bandwidths; an output
    that can be written, checked before any work: each is one line and exit 2."""
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    wide = tmp_path / "wide-fp8"
    _run(wide, True, 1100.0)
    lines = (wide / "metrics.jsonl").read_text().replace('"num_layers": 4', '"num_layers": 8')
    (wide / "metrics.jsonl").write_text(lines)
    two_ranks = tmp_path / "two-ranks-fp8"  # its step holds its collectives already
    _run(two_ranks, True, 1100.0)
    lines = (two_ranks / "metrics.jsonl").read_text()
    (two_ranks / "metrics.jsonl").write_text(lines.replace('"world_size": 1', '"world_size": 2'))
    numerics = tmp_path / "numerics-fp8"
    _run(numerics, True, 400.0)
    lines = (numerics / "metrics.jsonl").read_text()
    (numerics / "metrics.jsonl").write_text(
        lines.replace('"fp8_numerics": false', '"fp8_numerics": true')
    )
    cases = {
        "give the BF16 run first, then its FP8 twin": [pair[1], pair[0]],
        "is not like": [pair[0], str(wide)],
        "fp8_numerics True vs False (only --fp8 may differ)": [pair[0], str(numerics)],
        "trained on 2 ranks: project a pair measured on one GPU": [pair[0], str(two_ranks)],
        "the bandwidths must be positive": [*pair, "--node_gbs", "nan"],
        "the bandwidths must be positive and finite": [*pair, "--network_gbs", "inf"],
        "is not a directory": [*pair, "--output", str(tmp_path / "no" / "p.png")],
        "must end in .png": [*pair, "--output", str(tmp_path / "p.txt")],
    }
    for words, argv in cases.items():
        with pytest.raises(SystemExit) as refused:
            ps.main(argv)
        [err] = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
        assert refused.value.code == 2 and err.startswith("project_scale.py: error: ")
        assert words in err, (words, err)
    assert not list(tmp_path.glob("*.png"))


def test_a_metrics_line_still_being_written_is_left_out_and_a_damaged_one_named(
    tmp_path, capsys
) -> None:
    """A run still writing its metrics.jsonl ends in half a line: read as compare_runs reads it
    (left out), where it was "Expecting value: line 1 column 33" naming no file; a damaged line
    before the last is refused with its file and line."""
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    assert ps.main(pair) == 0
    whole = capsys.readouterr().out
    with open(tmp_path / "fp8" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 21, "loss')
    assert ps.main(pair) == 0
    assert capsys.readouterr().out == whole
    with open(tmp_path / "fp8" / "metrics.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(SystemExit) as refused:
        ps.main(pair)
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        f"project_scale.py: error: {pair[1]}/metrics.jsonl: line 22 is not JSON (Unterminated "
        "string starting at): fix or delete that line\n"
    )


def test_a_damaged_trace_is_refused_not_taken_for_no_trace(tmp_path, capsys) -> None:
    """Flipped bytes inside a run's .gz trace (zlib's error) were a traceback; caught as no
    trace, the projection would have gone on without the measured shares."""
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    trace = tmp_path / "fp8" / "profile" / "step_20" / "rank_0.pt.trace.json.gz"
    trace.parent.mkdir(parents=True)
    whole = gzip.compress(b'{"traceEvents": []}', mtime=0)
    trace.write_bytes(whole[:10] + b"\x07" + whole[11:])  # a deflate block of the reserved type
    with pytest.raises(SystemExit) as refused:
        ps.main(pair)
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        f"project_scale.py: error: {trace} cannot be read as a profiler trace: "
        "error('Error -3 while decompressing data: invalid block type'); profile it again or "
        "delete it\n"
    )


def _preflight(nodes: int, node_gbs: float, network_gbs: float) -> dict:
    scopes = {"within each node": node_gbs, "across nodes": network_gbs, "all ranks": 1.0}
    if nodes == 1:
        scopes = {"within the node": node_gbs}
    rows = [
        {"op": op, "payload": p, "scope": s, "bus_gbs": gbs * (2 if p == "fp32" else 1) / share}
        for p in ("bf16", "fp32")
        for s, gbs in scopes.items()
        for op, share in (("all_gather", 1), ("reduce_scatter", 2))
    ]
    return {"nodes": nodes, "backend": "nccl", "collectives": rows}


def test_a_preflight_record_sets_the_links_it_measured(tmp_path, capsys) -> None:
    # bf16's all-gather sets the links, its reduce-scatter their reduce share; NCCL overlaps
    assert ps.links_of(_preflight(2, 80.0, 3.0)) == ps.Links(80.0, 3.0, 0.5, overlap=True)
    one_node = ps.links_of(_preflight(1, 90.0, 0.0), ps.Links(1.0, 7.0))
    assert one_node == ps.Links(90.0, 7.0, 0.5)  # no network measured: the given one stays
    gloo = ps.links_of(_preflight(2, 80.0, 3.0) | {"backend": "gloo"})
    assert not gloo.overlap  # CPU ranks wait on gloo: nothing hides a collective
    job = ps.Job(1e8, 2e8, 8, 8192, 10_000.0, gather_bytes=4.0)
    fast, slow = ps.Links(100.0, 20.0), ps.Links(100.0, 0.5)
    same = ps.projected(job, (2, 1), 2, 1, links=fast, base_links=fast)
    assert same == pytest.approx(job.tokens_per_sec)  # the measured scale and links: itself
    assert ps.projected(job, (2, 1), 2, 1, links=slow, base_links=fast) < same / 2
    hidden = ps.exposed_seconds(job, 2, 1, links=slow)
    assert ps.exposed_seconds(job, 2, 1, links=dataclasses.replace(slow, overlap=False)) > hidden
    halved = dataclasses.replace(slow, reduce_share=0.5)
    assert ps.exposed_seconds(job, 2, 1, links=halved) > hidden  # slower reduces, more exposed
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    record = tmp_path / "preflight.json"
    record.write_text(json.dumps(_preflight(2, 360.0, 0.01)))
    assert ps.main([*pair, "--nodes", "2", "--preflight", str(record)]) == 0
    out = capsys.readouterr().out
    slowed = _bf16_column(out)
    assert f"links: 360 GB/s in a node (measured: {record}), 0.01 GB/s per GPU across nodes " in out
    assert ps.main([*pair, "--nodes", "2", "--node_gbs", "100"]) == 0
    out = capsys.readouterr().out
    assert slowed < _bf16_column(out) / 2  # 0.01 GB/s across the nodes
    assert (  # a one-node preflight measures no network: the table says what it assumed
        "links: 100 GB/s in a node (given: --node_gbs), 50 GB/s per GPU across nodes (assumed: "
        "--network_gbs's default)"
    ) in out
    # a bandwidth given and measured: which one the table used said only "measured"
    with pytest.raises(SystemExit) as bad:
        ps.main([*pair, "--network_gbs", "10", "--preflight", str(record)])
    assert bad.value.code == 2 and capsys.readouterr().err == (
        f"project_scale.py: error: --network_gbs or --preflight {record}, which measured it: "
        "not both\n"
    )
    for text, why in (("{}", "no 'collectives' field"), ("[]", "no 'collectives' field")):
        record.write_text(text)
        with pytest.raises(SystemExit) as bad:
            ps.main([*pair, "--preflight", str(record)])
        said = f"--preflight {record}: not a run's preflight.json ({why})\n"
        assert bad.value.code == 2 and capsys.readouterr().err.endswith(said)
    with pytest.raises(SystemExit) as bad:
        ps.main([*pair, "--preflight", str(tmp_path / "none.json")])
    assert "none.json: cannot be read (" in capsys.readouterr().err


def test_a_run_given_by_its_metrics_file_projects_as_its_folder(tmp_path, capsys) -> None:
    """compare_runs takes a run's metrics.jsonl for the run: so does the projection (it read
    FOLDER/metrics.jsonl/metrics.jsonl, "no such file" of a file that is there)."""
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    assert ps.main(pair) == 0
    by_folder = capsys.readouterr().out
    assert ps.main([pair[0], f"{pair[1]}/metrics.jsonl"]) == 0
    assert capsys.readouterr().out == by_folder


def _bf16_column(out: str) -> float:
    return float(out.splitlines()[1].split()[4].replace(",", ""))


def test_a_profiled_run_brings_its_measured_exposed_collectives(tmp_path) -> None:
    """With traces (--profile_steps) the compute under the projection is the measured step less
    what the trace shows exposed, not the model's own estimate at the measured scale, and a
    layer's forward and backward compute (what hides its gathers and reduces) are the trace's,
    not a third and two thirds of the step."""
    import shutil

    from analysis import step_breakdown

    run = Path(_run(tmp_path / "bf16", False, 1000.0))
    untraced = ps.job_of(str(run))
    assert untraced.exposed_share is None and untraced.compute_shares == (1 / 3, 2 / 3)
    window = run / "profile" / "step_20"
    window.mkdir(parents=True)
    traces = Path(__file__).parents[1] / "traces"
    shutil.copy(traces / "h100_bf16.pt.trace.json.gz", window / "rank_0.pt.trace.json.gz")
    slowest = step_breakdown.read_run(run, None).slowest
    job = ps.job_of(str(run))
    assert job.exposed_share == slowest.ms["comm_exposed"] / slowest.total_ms
    quarter = dataclasses.replace(job, exposed_share=0.25)
    assert ps.projected(quarter, (1, 1), 1, 1) == pytest.approx(job.tokens_per_sec / 0.75)
    forward, backward = job.compute_shares
    assert forward == pytest.approx(slowest.forward_ms / slowest.total_ms)
    assert 0.2 < forward < backward < 1 - forward  # the H100 step: a backward of ~1.8 forwards
    # the measured backward is shorter than two forwards: it hides less of the reduce-scatters
    slow = ps.Links(network=0.01)  # a layer's reduce outlasts its backward, not its forward
    traced_exposed = ps.exposed_seconds(job, 8, 8, links=slow)
    assert traced_exposed > ps.exposed_seconds(untraced_like(job), 8, 8, links=slow)


def untraced_like(job: ps.Job) -> ps.Job:
    return dataclasses.replace(job, compute_shares=(1 / 3, 2 / 3))


def test_the_projection_shows_what_is_exposed_and_draws_it(tmp_path, capsys) -> None:
    pair = [_run(tmp_path / "bf16", False, 1000.0), _run(tmp_path / "fp8", True, 1200.0)]
    png = tmp_path / "projection.png"
    slow = ["--network_gbs", "0.5", "--output", str(png)]
    assert ps.main([*pair, "--nodes", "1,4", "--gpus_per_node", "8", *slow]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "exposed ms: bf16 fp8+ag" in out[0] and out[-1] == f"picture: {png}"
    rows = [line.split() for line in out[1:] if line[0].isdigit()]  # then the links, the picture
    exposed = {tuple(row[:4]): [float(x) for x in row[-2:]] for row in rows}
    assert out[-2].startswith("links: 360 GB/s in a node (assumed: --node_gbs's default), 0.5 GB/s")
    one, four = exposed[("1", "x", "8", "full")], exposed[("4", "x", "8", "full")]
    assert four[0] > one[0] > 0  # a slow network leaves more exposed across nodes
    assert four[1] < four[0]  # the float8 all-gather moves half the bytes
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
