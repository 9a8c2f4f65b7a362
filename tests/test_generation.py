"""Generation: the sharded KV cache's layout, the sampling settings, and gloo runs at tp 2 and 4 against
``model.generate`` (tests/generation_workers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import autotp
from autotp.planning.plan import Plan
from autotp.runtime.generation import prompt_of
from autotp.runtime.pipeline import PipelineModule
from autotp.runtime.sampling import Settings, process, resolve
from tests import capture_cache, generation_workers
from tests.distributed import run_on_ranks

transformers = pytest.importorskip("transformers")


def _check(results: list[dict], kinds) -> None:
    for rank, result in enumerate(results):
        for kind in kinds:
            r = result[kind]
            assert r["greedy"], (rank, kind, r)
            assert r["steps"] == r["ref_steps"], (rank, kind, r)
            assert r["logit_diff"] < 1e-4, (rank, kind, r)
            assert r["sampled"] and r["same_on_ranks"], (rank, kind, r)
            assert r["transport"] == r["expected_transport"], (rank, kind, r)


def test_generation_at_two_ranks_equals_model_generate():
    results = run_on_ranks(generation_workers.generation_at_two, 2)
    _check(results, generation_workers.AT_TWO)
    for result in results:
        for kind in ("mistral", "mixtral"):
            mine, whole = result[kind]["cache_bytes"]
            assert 2 * mine == whole, (kind, mine, whole)  # each rank holds half the KV heads
        gpt = result["gpt"]
        assert gpt["greedy"] and gpt["sampled"] and gpt["same_on_ranks"], gpt
        assert "re-runs the whole sequence" in gpt["note"] and gpt["plan_note"]
        assert result["training"]["after"], result["training"]
        assert "input_ids" in result["training"]["refused"], result["training"]  # different prompts: refused


def test_a_spawned_generation_run_tears_its_group_down_before_exit():
    """Issue 23: a benchmark rank aborted at exit (``terminate called without an active exception``) when its gloo
    group, kept alive past ``destroy_process_group`` by torch's own module defaults, was freed during interpreter
    shutdown. Spawned ranks (as the benchmark runs; forked ones skip interpreter shutdown) generate over shared
    memory and must exit 0 with no gloo thread left at exit."""
    from bench import ranks
    from tests import teardown_workers

    results = ranks.run_on_ranks(teardown_workers.generation_then_exit, "cpu", [1, 1], start_method="spawn")
    assert [r["transport"] for r in results] == ["SharedMemoryComm"] * 2
    assert results[0]["tokens"] == results[1]["tokens"]


def test_generation_at_four_ranks_above_the_kv_heads():
    ids, _ = generation_workers._prompts()
    for kind in ("llama", "gpt2"):  # captured here once, not by each of 4 ranks on 2 cores (their cache steps are)
        capture_cache.warm(generation_workers._small(kind, 2).eval(), (ids,))
    results = run_on_ranks(generation_workers.generation_at_four, 4)
    _check(results, ("llama", "gpt2"))
    for result in results:
        mine, whole = result["llama"]["cache_bytes"]
        assert result["llama"]["replicas"] == [2] and 2 * mine == whole, result["llama"]  # one KV head of two
        mine, whole = result["gpt2"]["cache_bytes"]
        assert 4 * mine == whole
        assert result["gpt2"]["vocab_split"]  # 127 rows over 4 ranks: generated from the unevenly split head


def test_sampling_processing_is_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = Settings(5, True, 0.7, 10, 0.8, (), None)
    ref = scores
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        ref = warper(None, ref)
    assert torch.equal(process(scores, s), ref)


def test_settings_come_from_the_generation_config_then_defaults():
    config = transformers.GenerationConfig(max_new_tokens=7, top_k=5, eos_token_id=[3, 4])
    s = resolve(config, {"top_k": None, "temperature": 0.5})
    assert (s.max_new_tokens, s.top_k, s.temperature, s.top_p, s.eos, s.pad) == (7, 5, 0.5, 1.0, (3, 4), 3)
    assert resolve(None, {}).max_new_tokens == 20 and not resolve(None, {}).do_sample


def test_bad_settings_say_what_to_change():
    with pytest.raises(autotp.InputError, match="num_beams"):
        resolve(transformers.GenerationConfig(num_beams=4), {})
    with pytest.raises(autotp.InputError, match="max_new_tokens must be a positive integer"):
        resolve(None, {"max_new_tokens": 0})
    with pytest.raises(autotp.InputError, match="top_p"):
        resolve(None, {"top_p": 1.5})
    with pytest.raises(autotp.InputError, match="pad on the left"):
        prompt_of(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(autotp.InputError, match="2-D integer tensor"):
        prompt_of(torch.ones(3), None)


def test_plans_say_how_generate_runs_and_pipelines_refuse_it():
    """The plan notes it: a pipeline refuses generate (and its module says so at once), a model with no KV cache
    re-runs the sequence; a decoder with a cache at pp=1 needs no note."""
    ids = torch.zeros(2, 6, dtype=torch.long)
    llama = generation_workers._small("llama", 2)
    piped = autotp.plan(llama, tp=1, pp=2, example_inputs=(ids,))
    assert any("generation needs pp=1" in n for n in piped.notes), piped.notes
    assert not any("generat" in n for n in autotp.plan(llama, tp=2, example_inputs=(ids,)).notes)
    gpt = autotp.plan(generation_workers.build_gpt(), tp=2, example_inputs=(ids,))
    assert any("re-runs the whole sequence" in n and "add a cache" in n for n in gpt.notes), gpt.notes
    fake = SimpleNamespace(plan=Plan(tp=2, pp=2))
    with pytest.raises(autotp.PlanError, match="generation needs pp=1.*tp=4 with pp=1"):
        PipelineModule.generate(fake, torch.ones(1, 2, dtype=torch.long))


def test_the_generate_command_prints_tokens_and_speed(capsys):
    from autotp.tools.cli import main

    assert main(["generate", "examples/gpt.py:build_gpt", "--tp", "1", "--max-new-tokens", "3", "--batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines[0].split()) == 3 and "tokens/s at tp=1, batch 2, with re-running" in lines[-1]
    assert main(["generate", "hf:llama", "--tp", "1", "--ids", "1,x"]) != 0
    assert "--ids must be comma-separated integers" in capsys.readouterr().err


def test_the_cache_is_split_as_the_kv_heads_written_into_it():
    """Planned without processes: at tp=2 each rank holds one of Llama's 2 KV heads; at tp=4 (above them) the
    head its query heads use, shared by 2 ranks."""
    from autotp.capture.core.kv_cache import cache_shape, capture_step
    from autotp.passes.placement import local_shape
    from autotp.rewrite.cache_layout import cache_layouts

    model = generation_workers._small("llama", 2).eval()
    step = capture_step(model, cache_shape(model))
    ids = torch.zeros(2, 6, dtype=torch.long)
    for tp, replicas in ((2, 1), (4, 2)):
        plan = autotp.plan(model, tp, (ids,))
        layouts = list(cache_layouts(step, plan, 4).values())
        assert len(layouts) == 4  # K and V of 2 layers
        for lay in layouts:
            assert (lay.dim, lay.segments, lay.replicas) == (1, (2,), replicas)
            assert local_shape((3, 2, 16, 16), lay, tp) == (3, 1, 16, 16)


def test_a_meta_model_loaded_from_a_checkpoint_generates(tmp_path):
    """Weights only in a .safetensors file, the model on the meta device: the cache's shapes and the steps are
    captured on meta, and the steps read the loaded weights (one process, tp=1)."""
    from safetensors.torch import save_file

    model = generation_workers._small("llama", 2).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    with autotp.empty_weights():
        bare = generation_workers._small("llama", 2).eval()
    ids, mask = generation_workers._prompts()
    pm = autotp.parallelize(bare, tp=1, example_inputs=(ids,), checkpoint=tmp_path / "w.safetensors", quiet=True)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(pm.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), ref)


def test_recurrent_cache_layers_and_no_cache_re_run_and_say_why():
    """A structure decides, not a name: recurrent cache layers (a hybrid), or a forward with no cache at all."""
    from autotp.capture.core.kv_cache import why_no_cache

    class Hybrid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, vocab_size=64)

        def forward(self, input_ids, position_ids=None, past_key_values=None):
            return input_ids

    assert "linear_attention" in why_no_cache(Hybrid()) and "re-runs" in why_no_cache(Hybrid())
    assert "takes no cache" in why_no_cache(generation_workers.build_gpt())
    assert why_no_cache(generation_workers._small("llama", 2)) == ""


def test_the_cache_is_found_by_either_name_in_the_signature_and_the_output():
    """transformers 5.24 renamed the decoders' past_key_values keyword and output field to cache: both are read
    from the forward's signature and the output's fields (no version check)."""
    from autotp.capture.core.examples import Signature
    from autotp.capture.core.kv_cache import cache_keyword, output_cache, why_no_cache

    class New(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, cache=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, past_key_values=None):
            return input_ids

    class Neither(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, state=None):
            return input_ids

    assert cache_keyword(Signature.of(New())) == "cache"
    assert cache_keyword(Signature.of(Old())) == "past_key_values"
    assert cache_keyword(Signature.of(Neither())) is None
    assert "takes no cache" in why_no_cache(Neither())
    held = object()
    assert output_cache({"logits": 0, "cache": held}) is held
    assert output_cache({"logits": 0, "past_key_values": held}) is held
    assert output_cache({"logits": 0}) is None
    # the installed transformers' own decoder: whichever name it uses, its cache is found and sized
    model = generation_workers._small("llama", 2)
    assert cache_keyword(Signature.of(model)) in ("cache", "past_key_values")
    assert output_cache(model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True)) is not None


def test_the_parallel_module_keeps_no_copy_of_the_users_weights():
    """The user's weights are freed when dropped once the step is captured: at parallelize for a model in eval
    mode (the first generate then captures nothing), at the first generate for one in train mode (a training
    user's set-up pays nothing for generation); dropped before either, generate says what to do."""
    import gc
    import weakref

    ids, mask = generation_workers._prompts()
    for case in ("ahead", "first", "dropped"):
        model = generation_workers._small("llama", 2).eval()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        model.train(case != "ahead")
        with capture_cache.bypassed():  # the suite's capture memo keeps the model it first captured alive
            pm = autotp.parallelize(model, tp=1, example_inputs=(ids,), quiet=True)
        assert (pm.generation.cached is not None) == (case == "ahead"), case
        if case == "first":
            pm.generate(ids, max_new_tokens=1)
        weight = weakref.ref(model.model.embed_tokens.weight)
        del model
        gc.collect()
        assert weight() is None
        if case == "dropped":
            with pytest.raises(autotp.InputError, match="call pm.generate once"):
                pm.generate(ids, max_new_tokens=1)
        else:
            assert torch.equal(pm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), ref)


def test_an_eval_model_with_labels_or_no_cache_captures_no_step_ahead():
    """The step is captured ahead only for the inference shape: a model captured with labels (a training
    user's) or one with no KV cache (nothing to capture) leaves it to the first generate."""
    ids, _ = generation_workers._prompts()
    llama = generation_workers._small("llama", 2).eval()
    pm = autotp.parallelize(llama, tp=1, example_inputs={"input_ids": ids, "labels": ids}, quiet=True)
    assert pm.generation.cached is None
    from examples.gpt import build_gpt

    gpt = build_gpt().eval()
    pm = autotp.parallelize(gpt, tp=1, example_inputs=(ids % 64,), quiet=True)
    assert pm.generation.cached is None and pm.generation.no_cache


def _shared_pair(timeout: float = 30.0):
    """Two ranks' SharedMemoryComm over one folder, for threads of this process."""
    import shutil

    from autotp.runtime.shared_memory import SharedMemoryComm, make_folder

    folder = make_folder(2)
    comms = [SharedMemoryComm(rank, 2, folder, timeout) for rank in range(2)]
    for comm in comms:
        comm.connect()
    shutil.rmtree(folder)
    return comms


def test_shared_memory_collectives_are_exact_and_the_same_on_every_rank():
    """Sums in rank order (the same bits on both ranks), gathers, and values larger than a slot, over many
    collectives in a row (the two banks reused), each rank a thread."""
    from concurrent.futures import ThreadPoolExecutor

    from autotp.runtime.shared_memory import SLOT_BYTES

    comms = _shared_pair()
    sizes = [1, 1024, 7, SLOT_BYTES // 4 + 3, 0, 5] * 3
    values = [[torch.randn(n, generator=torch.Generator().manual_seed(10 * i + r)) for i, n in enumerate(sizes)]
              for r in range(2)]

    def rank_body(r):
        comm = comms[r]
        sums = [comm.all_reduce(v.view(-1, 1) if v.numel() else v) for v in values[r]]
        gathers = [comm.all_gather(torch.arange(3, dtype=torch.long) + 10 * r) for _ in range(3)]
        return sums, gathers, comm.reduce_scatter([torch.full((2,), 1.0 + r), torch.full((2,), 3.0 + r)])

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank_body, range(2)))
    for r, (sums, gathers, scattered) in enumerate(results):
        for i, s in enumerate(sums):
            expected = values[0][i] + values[1][i]
            assert torch.equal(s.reshape(-1), expected), (r, i)
        assert all(torch.equal(g[1], torch.arange(3) + 10) and g[0].dtype == torch.long for g in gathers)
        assert torch.equal(scattered, torch.full((2,), 3.0 if r == 0 else 7.0))


def test_shared_memory_names_the_rank_that_never_came():
    comm = _shared_pair(timeout=0.2)[0]
    with pytest.raises(autotp.RankFailure, match=r"waited 0.2 s for rank\(s\) \[1\]"):
        comm.all_reduce(torch.ones(3))
    comm.close()
    with pytest.raises(autotp.RankFailure, match="closed"):
        comm.all_reduce(torch.ones(3))


def test_shared_memory_completes_a_collective_whose_peer_already_left():
    """A peer that wrote its value and saw this rank's (its counter, written before this rank wakes it) may
    finish the collective and close its pipe, or exit, before the wake-up is written: this rank still
    completes it. A peer that closed its pipe before coming still fails it."""
    comm, peer = _shared_pair()
    peer._slot_views(torch.ones(3))[1].copy_(torch.full((3,), 2.0))  # the peer's value of collective 1,
    peer.count += 1
    peer._counters[1] = peer.count  # then its count, as _arrive writes them
    peer.close()
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), 3.0))

    waiting, gone = _shared_pair()
    gone.close()
    with pytest.raises(autotp.RankFailure, match="closed its end"):
        waiting.all_reduce(torch.ones(3))


def test_shared_memory_polls_long_only_with_a_core_per_process(monkeypatch):
    """A waiting rank polls for up to 2 ms only where every process of the job has a core; otherwise it blocks
    soon (its polling would hold the core a late peer needs)."""
    from autotp.runtime import shared_memory as sm

    monkeypatch.setattr(sm.os, "sched_getaffinity", lambda pid: {0, 1})
    assert sm.spin_seconds(2) == sm.SPIN_SECONDS
    assert sm.spin_seconds(4) == sm.SHORT_SPIN_SECONDS  # 4 processes on 2 cores


def test_shared_memory_polls_less_while_peers_come_late():
    """Each wait that blocked halves the next one's polling (down to the short spin); waits that did not regrow it
    (up to the most the host allows)."""
    from autotp.runtime.shared_memory import SHORT_SPIN_SECONDS, SPIN_SECONDS, adapted_polling

    polling = SPIN_SECONDS
    for _ in range(20):
        polling = adapted_polling(polling, True, SPIN_SECONDS)
    assert polling == SHORT_SPIN_SECONDS
    for _ in range(100):
        polling = adapted_polling(polling, False, SPIN_SECONDS)
    assert polling == SPIN_SECONDS
    assert adapted_polling(SHORT_SPIN_SECONDS, False, SHORT_SPIN_SECONDS) == SHORT_SPIN_SECONDS
