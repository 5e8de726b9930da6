"""Backbone: layout strings, mixers, streaming, Hugging Face round trip, configs."""

import pytest
import torch

from conftest import layer_options
from memzoo.backbone import HybridLM, LayoutError, parse_layout
from memzoo.backbone.attention import GatedAttention, local_attention
from memzoo.backbone.gdn import GDNMixer
from memzoo.config import ConfigError, ModelConfig, load_config

TINY = dict(vocab_size=67, d_model=32, n_layers=4, ffn_dim=64, attn_heads=4, attn_kv_heads=2, attn_head_dim=8,
            window=6, gdn_heads=2, gdn_head_dim=16, gdn_chunk=8)


# ---- layout strings -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, mixers",
    [
        ("GDN", ["GDN"] * 12),
        ("GDN+SWA", ["GDN", "GDN", "GDN", "SWA"] * 3),
        ("GDN+FA", ["GDN", "GDN", "GDN", "FA"] * 3),
        ("FA", ["FA"] * 12),
        ("FA-pSWA", ["FA-pSWA"] * 12),
        ("gdn + fa-pswa", ["GDN", "GDN", "GDN", "FA-pSWA"] * 3),
        ("NONE", ["NONE"] * 12),
    ],
)
def test_paper_mixer_layouts_parse(text, mixers):
    assert list(parse_layout(text, 12).mixers) == mixers


def test_memory_positions_parse():
    lay = parse_layout("GDN+SWA | linear@2,6,10", 12)
    assert lay.memories == (("linear", (2, 6, 10)),)
    assert lay.memories_at(6) == ["linear"] and lay.memories_at(3) == []
    assert parse_layout("GDN | linear@all", 4).memories == (("linear", (0, 1, 2, 3)),)
    assert parse_layout("GDN | linear@last", 4).memories == (("linear", (3,)),)
    assert parse_layout("GDN | Linear@1 + linear@3", 4).memories == (("linear", (1,)), ("linear", (3,)))


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("XYZ", "unknown token mixer 'XYZ'"),
        ("GDN+", "empty token mixer"),
        ("GDN+SWA+FA", "at most two"),
        ("GDN+GDN", "with itself"),
        ("GDN | ", "nothing after '|'"),
        ("GDN || linear@2", "more than one '|'"),
        ("GDN | linear@", "positions '' of 'linear'"),
        ("GDN | linear@x", "positions 'x'"),
        ("GDN | linear@12", "linear@12 is out of range"),
        ("GDN | linear@2,2", "repeat"),
        ("GDN | nosuchlayer@2", "unknown memory layer 'nosuchlayer'"),
        ("GDN | linear", "needs positions"),
        ("GDN | linear@-1", "positions '-1'"),
        ("GDN | 3linear@2", "cannot read memory item"),
    ],
)
def test_malformed_layouts_give_one_line_errors(bad, needle):
    with pytest.raises(LayoutError) as e:
        parse_layout(bad, 12)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    assert repr(bad) in msg  # the message quotes the layout it rejects


# ---- mixers stream exactly ----------------------------------------------------------------
def _split_equal(mixer, x, a):
    full, _ = mixer(x)
    y1, c = mixer(x[:, :a])
    y2, _ = mixer(x[:, a:], c)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a", [1, 5, 8, 13])
def test_gdn_mixer_streams(a):
    torch.manual_seed(0)
    _split_equal(GDNMixer(32, num_heads=2, head_dim=16, chunk_size=8), torch.randn(2, 21, 32), a)


def test_gdn_mixer_is_gated_deltanets_equations():
    """The mixer (the `gated_deltanet` layer with its query convolved) against the module docstring's
    equations written here: causal depthwise conv1d + SiLU on q, k, v, L2-normalised q and k, β and the
    Mamba-2 decay, fla's token-by-token gated delta rule (fla.ops.gated_delta_rule.naive), the per-head
    RMSNorm gated by silu(W_g x), W_o; in fp64."""
    import torch.nn.functional as F

    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive").naive_recurrent_gated_delta_rule
    torch.manual_seed(0)
    H, K = 2, 8
    mix = GDNMixer(16, num_heads=H, head_dim=K, chunk_size=4).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)

    def short_conv(u, w):  # w taps first [4, C]: conv1d's depthwise weight is its transpose
        return F.silu(F.conv1d(F.pad(u.transpose(1, 2), (3, 0)), w.t()[:, None], groups=u.shape[-1]).transpose(1, 2))

    heads = lambda u: u.unflatten(-1, (H, K))  # noqa: E731
    q = F.normalize(heads(short_conv(x @ mix.q_proj.weight.T, mix.q_conv)), dim=-1)
    k = F.normalize(heads(short_conv(x @ mix.k_proj.weight.T, mix.k_conv)), dim=-1)
    v = heads(short_conv(x @ mix.v_proj.weight.T, mix.v_conv))
    beta = torch.sigmoid(x @ mix.b_proj.weight.T)
    g = -mix.A_log.exp() * F.softplus(x @ mix.a_proj.weight.T + mix.dt_bias)
    o, S = naive(q.float(), k.float(), v.float(), beta.float(), g.float(), scale=K ** -0.5, output_final_state=True)
    o, S = o.double(), S.double()  # fla's reference computes in fp32
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mix.eps) * mix.o_norm_weight * F.silu(heads(x @ mix.g_proj.weight.T))
    y, cache = mix(x)
    torch.testing.assert_close(y, o.flatten(-2) @ mix.o_proj.weight.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["S"], S, atol=1e-5, rtol=1e-5)


def test_gdn_mixer_draws_its_weights_in_the_published_order():
    """A seed builds the mixer the published hybrid backbones were trained from: torch's default
    nn.Linear init of W_q, W_k, W_v, W_a, W_b, W_g, W_o, nn.Conv1d's of the q, k, v convolutions, then
    A ~ U(1e-4, 16) and dt ~ logU(1e-3, 1e-1) (Mamba-2's init), in this order, and the generator is
    left where those draws leave it. A state dict of the mixer before it was the layer (ShortConv
    modules: `q_conv.weight`) loads."""
    import math

    torch.manual_seed(0)
    d, H, K = 16, 2, 8
    lins = [torch.nn.Linear(d, n, bias=False).weight for n in (H * K, H * K, H * K, H, H, H * K)]
    lins.append(torch.nn.Linear(H * K, d, bias=False).weight)
    convs = [torch.nn.Conv1d(H * K, H * K, 4, groups=H * K, bias=False).weight[:, 0].t() for _ in range(3)]
    A = torch.empty(H).uniform_(1e-4, 16.0)
    dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    after = torch.rand(3)
    torch.manual_seed(0)
    mix = GDNMixer(d, num_heads=H, head_dim=K)
    got = [getattr(mix, f"{n}_proj").weight for n in "qkvabgo"]
    assert all(torch.equal(a, b) for a, b in zip(got, lins))
    assert all(torch.equal(getattr(mix, f"{n}_conv"), w) for n, w in zip("qkv", convs))
    torch.testing.assert_close(mix.A_log.exp(), A)
    torch.testing.assert_close(torch.nn.functional.softplus(mix.dt_bias), dt)
    assert torch.equal(torch.rand(3), after)
    old = {k.replace("_conv", "_conv.weight") if k.endswith("_conv") else k: v * 2 for k, v in mix.state_dict().items()}
    other = GDNMixer(d, num_heads=H, head_dim=K)
    other.load_state_dict(old)
    assert torch.equal(other.q_conv, 2 * mix.q_conv) and torch.equal(other.o_proj.weight, 2 * mix.o_proj.weight)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("a", [1, 7, 13])
def test_attention_streams(window, a):
    torch.manual_seed(0)
    _split_equal(GatedAttention(32, 4, 2, 8, window=window), torch.randn(2, 21, 32), a)


@pytest.mark.parametrize("a", [1, 2, 7, 13])
def test_attention_with_a_short_convolution_streams(a):
    torch.manual_seed(0)
    _split_equal(GatedAttention(32, 4, 2, 8, conv_size=4), torch.randn(2, 21, 32), a)


def test_attention_short_convolution_is_causal_and_local():
    """With conv size 4, q, k, v at t mix the inputs t-3..t only: perturbing a later token changes
    nothing before it, and without the attention (one head over one key) the mixer would still see
    3 tokens back: the key of position 1 carries token 0."""
    torch.manual_seed(0)
    att = GatedAttention(32, 4, 2, 8, conv_size=4)
    x = torch.randn(1, 10, 32)
    x2 = x.clone()
    x2[:, 6] += 1.0
    torch.testing.assert_close(att(x)[0][:, :6], att(x2)[0][:, :6])
    assert not torch.allclose(att(x)[0][:, 6], att(x2)[0][:, 6])
    assert sum(p.numel() for p in att.convs.parameters()) == (4 * 8 + 2 * 8 + 2 * 8) * 4


def test_short_convolution_is_the_grouped_conv1d():
    """causal_conv (shifted multiply-adds) against torch's depthwise conv1d, the reference, in
    values and gradients; and a hand-computed example: weights (1, 2, 3) over the inputs
    (0, 0 | 1, 10, 100) give 3·1, 2·1 + 3·10, 1·1 + 2·10 + 3·100."""
    import torch.nn.functional as F

    from memzoo.modules.conv import causal_conv

    torch.manual_seed(0)
    xp = torch.randn(2, 3 + 9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)  # taps first: [c, C]
    ref = F.conv1d(xp.transpose(1, 2), w.t()[:, None], groups=5).transpose(1, 2)
    got = causal_conv(xp, w)
    torch.testing.assert_close(got, ref)
    g = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(got, (xp, w), g), torch.autograd.grad(ref, (xp, w), g))
    hand = causal_conv(torch.tensor([0.0, 0.0, 1.0, 10.0, 100.0])[None, :, None], torch.tensor([[1.0], [2.0], [3.0]]))
    assert hand.flatten().tolist() == [3.0, 32.0, 321.0]


def test_short_convolutions_draw_conv1d_weights_and_load_its_layout():
    """GDN's and MoM's short convolutions store their weights taps first ([c, C]): drawn as
    nn.Conv1d draws its [C, 1, c] weight from the same seed, and a state dict in conv1d's layout
    (checkpoints saved before) loads into the same model."""
    from memzoo.modules.conv import ShortConv
    from memzoo.layers.mom import MoM

    torch.manual_seed(0)
    ref = torch.nn.Conv1d(6, 6, 4, groups=6, bias=False).weight  # [6, 1, 4]
    torch.manual_seed(0)
    conv = ShortConv(6, 4)
    assert conv.weight.shape == (4, 6) and torch.equal(conv.weight, ref[:, 0].t())
    old = {"weight": ref.detach() * 2}
    conv.load_state_dict(old)
    assert torch.equal(conv.weight, 2 * ref[:, 0].t())

    torch.manual_seed(0)
    mom = MoM(d_model=16, num_memories=2, topk=1, num_heads=2, head_dim=4, conv_size=4)
    sd = mom.state_dict()
    assert sd["k_conv"].shape == (4, mom.key_dim) and sd["v_conv"].shape == (4, mom.value_dim)
    flipped = {k: (v.t().contiguous() if k in ("k_conv", "v_conv") else v) for k, v in sd.items()}
    torch.manual_seed(1)
    other = MoM(d_model=16, num_memories=2, topk=1, num_heads=2, head_dim=4, conv_size=4)
    other.load_state_dict(flipped)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in sd.items())


def test_lact_loads_its_qk_affine_in_the_references_layout():
    """LaCT stores its q/k scale and offset as rows [2, d_model] (q, k); a state dict in the
    reference's [d_model, 2] layout (checkpoints saved before) loads into the same model, and the
    affine it applies is row 0 on q, row 1 on k."""
    from memzoo.layers.lact import LaCT

    torch.manual_seed(0)
    lact = LaCT(d_model=16, num_heads=2, chunk_size=8, rope_head_dim=8)
    with torch.no_grad():
        lact.qk_scale.copy_(torch.randn(2, 16))
        lact.qk_offset.copy_(torch.randn(2, 16))
    sd = lact.state_dict()
    assert sd["qk_scale"].shape == (2, 16)
    old = {k: (v.t().contiguous() if k in ("qk_scale", "qk_offset") else v) for k, v in sd.items()}
    other = LaCT(d_model=16, num_heads=2, chunk_size=8, rope_head_dim=8)
    other.load_state_dict(old)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in sd.items())
    x = torch.randn(2, 8, 16)
    before = lact.project(x, lact.init_state(2))
    with torch.no_grad():
        lact.qk_scale[1] += 1.0  # k's row: q stays, k moves
    after = lact.project(x, lact.init_state(2))
    assert torch.equal(before["q"], after["q"]) and not torch.allclose(before["k"], after["k"])


def test_no_mixer_sees_each_token_alone():
    torch.manual_seed(0)
    model = HybridLM.from_layout("NONE", **TINY).eval()
    ids = torch.randint(0, 67, (1, 12))
    other = ids.clone()
    other[0, :11] = (ids[0, :11] + 1) % 67  # every token but the last changed
    torch.testing.assert_close(model(ids).logits[:, -1], model(other).logits[:, -1])


def test_swa_is_local_and_fa_is_not():
    torch.manual_seed(0)
    swa, fa = GatedAttention(32, 4, 2, 8, window=4), GatedAttention(32, 4, 2, 8)
    fa.load_state_dict(swa.state_dict())
    x = torch.randn(1, 12, 32)
    x2 = x.clone()
    x2[:, 0] += 1.0  # perturb token 0: outside the window of the last query
    assert torch.allclose(swa(x)[0][:, -1], swa(x2)[0][:, -1])
    assert not torch.allclose(fa(x)[0][:, -1], fa(x2)[0][:, -1])


def _windowed_softmax_attention(q, k, v, window):
    """The definition, one query at a time: softmax over the keys t-w < s <= t of its k/v head."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    out = torch.zeros_like(q)
    for h in range(H):
        kh, vh = k[:, h // (H // kv)], v[:, h // (H // kv)]
        for t in range(T):
            lo = max(0, t - window + 1)
            p = torch.softmax(q[:, h, t, None] @ kh[:, lo : t + 1].transpose(-1, -2) / D**0.5, -1)
            out[:, h, t] = (p @ vh[:, lo : t + 1])[:, 0]
    return out


@pytest.mark.parametrize("T, window, H, kv", [(12, 4, 4, 2), (13, 4, 4, 2), (9, 1, 2, 2), (11, 10, 4, 1), (5, 3, 6, 3)])
def test_local_attention_is_windowed_softmax_attention(T, window, H, kv):
    """The block-local form (O(T·w)) against the definition, outputs and gradients, with T not a
    multiple of the window, one key per query, a window just short of T and grouped k/v heads."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, T, 8, dtype=torch.float64, requires_grad=True) for h in (H, kv, kv))
    got, want = local_attention(q, k, v, window), _windowed_softmax_attention(q, k, v, window)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g))


def test_pswa_draws_only_in_training():
    att = GatedAttention(32, 4, 2, 8, window=4, p_window=0.5)
    att.eval()
    assert att._window_now() is None
    att.train()
    torch.manual_seed(0)
    draws = {att._window_now() for _ in range(50)}
    assert draws == {None, 4}


# ---- the model ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout, conv", [("GDN", 0), ("GDN+SWA | linear@1,3", 0), ("FA", 0), ("FA-pSWA | linear@all", 0),
                                          ("GDN+SWA", 4), ("NONE | linear@1", 0)])
def test_model_streams_across_calls(layout, conv):
    torch.manual_seed(0)
    model = HybridLM.from_layout(layout, **TINY, attn_conv=conv).eval()
    ids = torch.randint(0, 67, (2, 20))
    full = model(ids).logits
    out1 = model(ids[:, :9], use_cache=True)
    out2 = model(ids[:, 9:], cache=out1.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([out1.logits, out2.logits], 1), full, atol=1e-4, rtol=1e-4)


def test_new_sequence_resets_per_sequence_memory():
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN | linear@1", **TINY).eval()
    ids = torch.randint(0, 67, (1, 10))
    a = model(ids).logits
    model(torch.randint(0, 67, (1, 10)))  # an unrelated sequence in between
    torch.testing.assert_close(model(ids).logits, a)


def test_loss_and_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | linear@2", **TINY)
    ids = torch.randint(0, 67, (2, 16))
    out = model(ids[:, :-1], targets=ids[:, 1:])
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    # the Hugging Face `labels` form gives the same loss
    lab = model(ids[:, :-1], labels=ids[:, :-1])
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:-1].flatten())
    torch.testing.assert_close(lab.loss, ref)


def test_save_pretrained_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = HybridLM.from_layout("GDN+SWA | linear@1,3", **TINY).eval()
    ids = torch.randint(0, 67, (2, 12))
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.layout == "GDN+SWA | linear@1,3" and cfg.model_type == "memzoo"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HybridLM)
    assert torch.equal(loaded(ids).logits, ref)


def test_configs_reject_unknown_keys(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'd_model'"):
        ModelConfig.from_dict({"dmodel": 3})
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  layout: GDN\ntrain:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match="'stpes'.*did you mean 'steps'"):
        load_config(p)
    with pytest.raises(ConfigError, match="shipped configs"):
        load_config("paper/nope")
    with pytest.raises(ValueError, match="unknown option"):
        HybridLM.from_layout("GDN | linear@1", **{**TINY, "memory": {"linear": {"no_such_option": 1}}})


@pytest.mark.parametrize("site, order", [("before_mixer", ["mem", "mixer", "ffn"]),
                                         ("after_mixer", ["mixer", "mem", "ffn"]),
                                         ("after_ffn", ["mixer", "ffn", "mem"])])
def test_a_memory_runs_at_its_site(site, order, monkeypatch):
    from memzoo.layers.linear_attention import LinearAttentionMemory

    monkeypatch.setattr(LinearAttentionMemory, "site", site)
    block = HybridLM.from_layout("GDN | linear@1", **TINY).blocks[1]
    calls = []
    for what, mod in (("mixer", block.mixer), ("mem", block.mems[0]), ("ffn", block.ffn)):
        mod.register_forward_hook(lambda *_, what=what: calls.append(what))
    block(torch.randn(1, 5, 32), None, None)
    assert calls == order


def test_a_memory_at_the_ffn_site_replaces_the_ffn_and_a_bad_site_is_an_error(monkeypatch):
    from memzoo.layers.linear_attention import LinearAttentionMemory
    from memzoo.layers.pkm import PKM

    block = HybridLM.from_layout("GDN | pkm@1", **TINY, memory={"pkm": layer_options("pkm")}).blocks[1]
    assert isinstance(block.ffn, PKM) and not block.mems
    monkeypatch.setattr(LinearAttentionMemory, "site", "mixer")
    with pytest.raises(ValueError, match="site 'mixer'; expected one of before_mixer, after_mixer, ffn, after_ffn"):
        HybridLM.from_layout("GDN | linear@1", **TINY)


def test_wrong_input_dtype_is_explained():
    model = HybridLM.from_layout("GDN", **TINY)
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.randn(1, 4))


def test_paper_params_match_table2():
    """All 16 rows of Table 2, counted on the meta device, within 0.5% (in fact < 0.01%)."""
    from memzoo.backbone import count_params
    from memzoo.config import config_dir

    paths = [p for p in sorted((config_dir() / "paper").glob("*.yaml")) if "params_m" in load_config(p).paper]
    assert len(paths) == 16  # the Table 2 rows (other paper configs, e.g. LaCT, have no published count)
    for name, ref in [("paper/gdn", 112.11), ("paper/gdn-swa", 112.65), ("paper/gdn-fa", 112.65), ("paper/fa", 114.25)]:
        assert load_config(name).paper["params_m"] == ref
    for p in paths:
        rc = load_config(p)
        ref = rc.paper["params_m"]
        assert abs(count_params(rc.model) / 1e6 - ref) / ref < 0.005, (p.name, count_params(rc.model), ref)
