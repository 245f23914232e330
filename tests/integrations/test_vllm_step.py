"""kdax.integrations.vllm_tpu.step on batches laid out as vLLM's TPU engine lays them out (flat
ragged tokens, query_start_loc, seq_lens, page tables, state slots), built by hand here: ragged
prompt and decode mixes with chunked prefill and padding, verify steps with partial acceptance
(the rolled-back drafts), and align-mode prefix caching (read slots apart from write slots). Each
gives the tokens of kdax's generate() on the same tiny transformers checkpoint."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdax.integrations.vllm_tpu.step import StateSlots, StepBatch, forward, init_caches, kda_state_shapes
from kdax.models import from_pretrained, generate
from kdax.models.kda import is_kda

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
PAGE = 4  # tokens a page (and, in align mode, a state block)
R, T, M = 4, 24, 12  # requests, tokens and pages a request at most, of a step


# GLM-5.3 (7 minutes here, its greedy references compiling per prompt) by hand with -m slow
@pytest.fixture(
    scope="module",
    params=["kimi_a", *(pytest.param(c, marks=pytest.mark.slow) for c in ("ling_a", "glm5_b", "glm5_a"))],
)
def model(request):
    return from_pretrained(os.path.join(FIXTURES, request.param), backend="xla")


def _prompts(seed, lengths, vocab=128):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _greedy(model, prompt, new):
    out = generate(model, jnp.asarray([prompt], jnp.int32), new)
    return np.asarray(out)[0, len(prompt) :].tolist()


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step(graphdef, state, caches, batch, num_spec):
    model = nnx.merge(graphdef, state)
    hidden, caches = forward(model, caches, batch, num_spec=num_spec)
    return model._logits(hidden), caches


class Engine:
    """vLLM's side, reduced: requests with their pages and slots, flat steps of at most T tokens
    (decode and verify rows first, then prompt chunks of at most ``chunk`` tokens), greedy
    sampling and verification.

    Non-align mode: request i owns state slots 1 + i * (num_spec + 1) onwards (slot 0 is the
    null slot idle requests point at). Align mode: a request's state slots are a table over its
    state blocks of PAGE tokens, like its pages; it reads the slot of the block holding its last
    computed token and writes the block holding its last new token; prompts are cut at block
    boundaries.
    """

    def __init__(self, model, *, num_spec=0, align=False, chunk=7, drafts=None):
        self.model, self.num_spec, self.align, self.chunk, self.drafts = model, num_spec, align, chunk, drafts
        self.graphdef, self.state = nnx.split(model)
        self.caches = init_caches(model, 64, 96, PAGE, width=None)
        self.free_pages, self.free_slots = list(range(96)), list(range(1, 64))
        self.requests = []
        self.verified = 0  # draft tokens accepted
        self.rejected = 0

    def add(self, prompt, new, *, shared=None):
        """A request; ``shared``: an earlier request whose first full blocks it reuses (a prefix hit)."""
        r = {"tokens": list(prompt), "prompt": len(prompt), "new": new, "computed": 0, "pages": [], "slots": []}
        if shared is not None:
            same = 0
            while same < min(len(prompt), shared["computed"]) and prompt[same] == shared["tokens"][same]:
                same += 1
            blocks = same // PAGE
            if blocks * PAGE == len(prompt):
                blocks -= 1  # keep a token to compute
            r["pages"] = shared["pages"][:blocks]
            r["slots"] = shared["slots"][:blocks]
            r["computed"] = blocks * PAGE
        elif not self.align:
            r["base"] = 1 + len(self.requests) * (self.num_spec + 1)
        self.requests.append(r)
        return r

    def _grow(self, r, length):
        while len(r["pages"]) * PAGE < length:
            r["pages"].append(self.free_pages.pop(0))
            r["slots"].append(self.free_slots.pop(0))

    def _schedule(self):
        rows, budget = [], T
        active = [r for r in self.requests if len(r["tokens"]) - r["prompt"] < r["new"]]
        decoding = [r for r in active if r["computed"] >= r["prompt"]]
        prefilling = [r for r in active if r["computed"] < r["prompt"]]
        for r in decoding[:R]:
            new = [r["tokens"][r["computed"]]] if r["computed"] < len(r["tokens"]) else []
            drafts = self.drafts(r, self.num_spec) if self.drafts else []
            rows.append((r, new + drafts, len(drafts)))
            budget -= len(new + drafts)
        for r in prefilling[: R - len(rows)]:
            n = min(self.chunk, r["prompt"] - r["computed"], budget)
            if self.align and r["computed"] + n < r["prompt"]:
                n = (r["computed"] + n) // PAGE * PAGE - r["computed"]
            if n > 0:
                rows.append((r, r["tokens"][r["computed"] : r["computed"] + n], 0))
                budget -= n
        return rows

    def step(self):
        rows = self._schedule()
        if not rows:
            return False
        tokens, positions, qsl = np.zeros(T, np.int32), np.full(T, 7, np.int32), [0]  # stale padding positions
        seq_lens, tables = np.zeros(R, np.int32), np.full((R, M), -1, np.int32)
        write, read = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for i, (r, new, _) in enumerate(rows):
            a, n = qsl[-1], len(new)
            tokens[a : a + n] = new
            positions[a : a + n] = r["computed"] + np.arange(n)
            qsl.append(a + n)
            seq_lens[i] = r["computed"] + n
            self._grow(r, seq_lens[i])
            tables[i, : len(r["pages"])] = r["pages"]
            if self.align:
                write[i] = r["slots"][(seq_lens[i] - 1) // PAGE]
                read[i] = r["slots"][max(r["computed"] - 1, 0) // PAGE]
            else:
                write[i] = r["base"]
        qsl += [qsl[-1]] * (R + 1 - len(qsl))  # padding requests repeat the last offset
        kda = StateSlots(jnp.asarray(write), jnp.asarray(read) if self.align else None)
        layers = tuple(kda if is_kda(b) else jnp.asarray(tables) for b in self.model.model.layers)
        batch = StepBatch(*map(jnp.asarray, (tokens, positions, np.asarray(qsl, np.int32), seq_lens)), layers)
        logits, self.caches = _step(self.graphdef, self.state, self.caches, batch, self.num_spec)
        picks = np.asarray(jnp.argmax(logits, -1))
        for i, (r, new, k) in enumerate(rows):
            end = qsl[i + 1]
            r["computed"] += len(new)
            if r["computed"] < r["prompt"]:
                continue
            if k:  # verify: accept drafts while they equal the model's pick
                drafts, guess = new[-k:], picks[end - k - 1 : end]
                a = 0
                while a < k and drafts[a] == guess[a]:
                    a += 1
                self.verified, self.rejected = self.verified + a, self.rejected + k - a
                del r["tokens"][len(r["tokens"]) - k + a :]  # the rejected drafts
                r["computed"] -= k - a
                r["tokens"].append(int(guess[a]))
            else:
                r["tokens"].append(int(picks[end - 1]))
        return True

    def run(self):
        while self.step():
            pass
        return [r["tokens"][r["prompt"] : r["prompt"] + r["new"]] for r in self.requests]


def _oracle(reference_by_prompt):
    """Drafts from the reference continuation with every third one altered: some verify steps
    accept every draft, some part, some none."""

    def draft(r, k):
        ref = reference_by_prompt[tuple(r["tokens"][: r["prompt"]])]
        done = len(r["tokens"]) - r["prompt"]
        guess = ref[done : done + k]
        guess = [(t + 1) % 128 if (done + i) % 3 == 2 else t for i, t in enumerate(guess)]
        r["tokens"].extend(guess)
        return guess

    return draft


LENGTHS, NEW = (11, 1, 17, 6, 3), (6, 8, 4, 9, 5)


@pytest.fixture(scope="module")
def reference(model):
    return [_greedy(model, p, n) for p, n in zip(_prompts(0, LENGTHS), NEW)]


def test_state_layout_is_the_engines(model):
    kda = next(b.attn for b in model.model.layers if is_kda(b))
    conv, state, tag = kda_state_shapes(kda)
    c = model.config
    assert conv == (c.linear_conv_kernel_dim, 3 * c.linear_num_heads * c.linear_head_dim)
    assert state == (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim) and tag == (1,)


def test_ragged_prompts_and_decodes_give_the_tokens_of_generate(model, reference):
    """Five requests, prompts of 1 to 17 tokens cut into chunks of 7 beside other requests'
    decode tokens, four at a time, stale positions and padding requests in every step."""
    e = Engine(model)
    for p, n in zip(_prompts(0, LENGTHS), NEW):
        e.add(p, n)
    assert e.run() == reference


def test_verify_steps_with_partial_acceptance_give_the_tokens_of_generate(model, reference):
    """Three drafts a step, right, partly right and wrong: the rolled-back states continue as
    plain decoding does (the next step starts from the state after the last accepted token)."""
    ref = {tuple(p): r for p, r in zip(_prompts(0, LENGTHS), reference)}
    e = Engine(model, num_spec=3, drafts=_oracle(ref))
    for p, n in zip(_prompts(0, LENGTHS), NEW):
        e.add(p, n)
    assert e.run() == reference
    assert e.verified > 0 and e.rejected > 0


def test_align_mode_prefix_hits_give_the_tokens_of_generate(model):
    """Align-mode prefix caching: a request that shares the first 9 tokens of an earlier one
    starts from the state checkpointed at the block boundary (8 tokens) in the earlier request's
    slot, writes its own, and shares the pages."""
    first, second = _prompts(1, (13, 6))
    second = first[:9] + second
    e = Engine(model, align=True, chunk=6)
    a = e.add(first, 5)
    e.run()
    b = e.add(second, 5, shared=a)
    assert b["computed"] == 8 and b["slots"][1] == a["slots"][1]
    out = e.run()
    assert out == [_greedy(model, first, 5), _greedy(model, second, 5)]


def test_plugin_refuses_another_tpu_inference_and_leaves_processes_without_it_alone(monkeypatch):
    import importlib.metadata

    from kdax.integrations import vllm_tpu

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert vllm_tpu.register() is None  # vLLM on GPU, or no vLLM: nothing to register
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.31.0")
    with pytest.raises(RuntimeError, match=r"tpu-inference 0\.32\.0.*found 0\.31\.0"):
        vllm_tpu.register()


def test_verify_steps_run_the_recurrent_form_on_the_short_requests_alone(model, monkeypatch):
    """A step with drafts and a prompt chunk: the KDA layers run the chunked form over the step and
    the recurrent form over a row of at most R * (num_spec + 1) tokens (the verify rows'), not over
    the prompt chunk; the MLA layers run the paged op (GLM's indexed layers: the indexed op over the
    pages' latents)."""
    from kdax.nn import dsa, mla
    from kdax.nn.kda import KimiDeltaAttention

    calls, paged = [], []
    kda_call, mla_call, dsa_call = KimiDeltaAttention.__call__, mla.paged_latent_attention, dsa.indexed_attention

    def spy(self, x, **kw):
        calls.append((kw.get("mode"), x.shape[1]))
        return kda_call(self, x, **kw)

    def spy_paged(*args, **kw):
        paged.append(args[0].shape)
        return mla_call(*args, **kw)

    monkeypatch.setattr(KimiDeltaAttention, "__call__", spy)
    monkeypatch.setattr(mla, "paged_latent_attention", spy_paged)
    monkeypatch.setattr(dsa, "indexed_attention", lambda *a, **kw: paged.append(a[1].shape) or dsa_call(*a, **kw))
    num_spec, big_T = 1, 40
    caches = init_caches(model, 8, 24, PAGE)
    qsl = np.array([0, 2, 32, 33, 33], np.int32)  # a verify row of 2, a chunk of 30, a decode row, padding
    seq = np.array([9, 30, 5, 0], np.int32)
    tables = np.arange(4 * 8, dtype=np.int32).reshape(4, 8) % 24
    pos = np.concatenate([[7, 8], np.arange(30), [4], np.full(7, 3)]).astype(np.int32)
    layers = tuple(
        StateSlots(jnp.asarray([1, 3, 5, 7], jnp.int32)) if is_kda(b) else jnp.asarray(tables)
        for b in model.model.layers
    )
    batch = StepBatch(jnp.ones(big_T, jnp.int32), jnp.asarray(pos), jnp.asarray(qsl), jnp.asarray(seq), layers)
    hidden, _ = forward(model, caches, batch, num_spec=num_spec)
    assert hidden.shape == (big_T, model.config.hidden_size) and np.isfinite(np.asarray(hidden)).all()
    kda_layers = sum(is_kda(b) for b in model.model.layers)
    assert sorted(calls) == sorted([("chunk", big_T), ("fused_recurrent", 4 * (num_spec + 1))] * kda_layers)
    assert len(paged) == len(model.model.layers) - kda_layers


@pytest.mark.parametrize(  # slow: 170 s and more on the 2-core CI; the vllm-marked engine tests split the same way
    "checkpoint, heads_maps",
    [pytest.param("kimi_a", 7, marks=pytest.mark.slow), pytest.param("glm5_b", 6, marks=pytest.mark.slow)],
)
def test_step_split_as_the_engine_splits_it_equals_one_device(checkpoint, heads_maps):
    """Fake CPU devices, the weights placed as the plugin places them on the engine's mesh:
    - tensor parallel 2: the KDA and paged MLA ops run per shard of the heads (what the TPU
      kernels need: XLA cannot partition a Mosaic call) and the MoE's experts on their own
      devices; hidden states and caches equal one device's;
    - two data-parallel attention groups of two devices (the heads split within a group, the
      attention weights also over the groups and gathered where used, the MLPs and experts over
      all four): two groups' batches side by side, each group's pages and slots
      on its own devices, equal each group's batch run alone.
    Kimi Linear, and GLM-5.3 (hyper-connections around each group's mixers; a shared indexed
    layer taking its group's selection from the layer before) by hand with -m slow."""
    import json
    import subprocess
    import sys

    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.integrations.vllm_step_tp_worker", os.path.join(FIXTURES, checkpoint)]
    run = subprocess.run(worker, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    # KDA: chunked and recurrent calls; MLA: paged; MoE: experts; with groups, each layer's mixer too
    assert r["heads"]["split"] > 10 and r["heads"]["shard_maps"] >= heads_maps
    assert r["groups"]["split"] > r["heads"]["split"]  # the latent projections too, over the groups
    assert r["groups"]["shard_maps"] >= r["heads"]["shard_maps"] + 4
    assert r["heads"]["max_rel"] < 1e-5 and r["groups"]["max_rel"] < 1e-5
