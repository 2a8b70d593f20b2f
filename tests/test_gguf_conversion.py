"""The GGUF -> Hugging Face conversion behind the embedded model alias (models/embedded.py convert_gguf_to_hf),
in the default suite: a tiny llama GGUF written here with the `gguf` package (as llama.cpp's converter writes
one: q/k rows permuted, tied embeddings as no output.weight, a byte-level BPE vocabulary with its merges), then
converted. The slow tests convert the real embedded SmolLM2 file; this one checks the result tensor by tensor."""

import json
from pathlib import Path

import gguf  # a dependency of rlora (pyproject.toml): transformers reads GGUF files with it
import numpy as np
import pytest
import torch

from rlora.models.embedded import convert_gguf_to_hf
from rlora.models.tiny import CHAT_TEMPLATE

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 48
# not transformers' defaults (10000, 1e-6): a conversion that drops them changes the logits
ROPE_THETA, RMS_EPS = 5000.0, 1e-5


def _tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a few sentences, its special tokens at ids 0-2 as in SmolLM2's vocabulary
    (GPT2Tokenizer, which transformers builds from a "gpt2" GGUF vocabulary, would append an <|endoftext|>
    that the vocabulary lacks, one id past the model's embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["What is 3 + 4? The answer is 7.", "Hello, how are you today?",
                                 "The quick brown fox jumps over the lazy dog."] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved rotary halves), written out here so
    the file is the one llama.cpp would write; transformers undoes it when it reads the file."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _source_model(vocab_size: int, pad_id: int, eos_id: int):
    """A random LlamaForCausalLM: every parameter drawn (norms too, so a swapped norm shows)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=256,
                         rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA, tie_word_embeddings=True,
                         pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _write_gguf(path, model, tokenizer) -> dict[str, np.ndarray]:
    """The model and tokenizer as a float32 GGUF file, the tensors under llama.cpp's names; -> those tensors."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for layer in range(LAYERS):
        for hf, ours in names.items():
            weights = state[f"model.layers.{layer}.{hf}.weight"]
            if ours == "attn_q":
                weights = _permute(weights, HEADS)
            elif ours == "attn_k":
                weights = _permute(weights, KV_HEADS)
            tensors[f"blk.{layer}.{ours}.weight"] = np.ascontiguousarray(weights)

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in backend["model"]["merges"]]
    special = {added["content"] for added in backend["added_tokens"] if added["special"]}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE, as SmolLM2's file says
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, weights in tensors.items():
        writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_a_tiny_llama_gguf_converts_to_the_model_and_tokenizer_it_holds(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _tokenizer()
    source = _source_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    gguf_path = tmp_path / "src" / "tiny.gguf"
    gguf_path.parent.mkdir()
    written = _write_gguf(gguf_path, source, tokenizer)
    folder = tmp_path / "cache" / "tiny-hf"

    convert_gguf_to_hf(gguf_path, folder)

    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-hf"]  # no temporary folder left behind
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == \
        ("llama", HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, len(tokenizer))
    assert config.tie_word_embeddings and config.rms_norm_eps == pytest.approx(RMS_EPS)
    assert config.rope_parameters["rope_theta"] == ROPE_THETA
    assert "quantization_config" not in config.to_dict()  # a plain folder, loadable without gguf
    got = model.state_dict()
    # against the tensors written, as written: the un-permuted ones byte for byte
    assert torch.equal(got["model.embed_tokens.weight"], torch.from_numpy(written["token_embd.weight"]))
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(written["blk.1.ffn_down.weight"]))
    assert torch.equal(got["model.layers.0.post_attention_layernorm.weight"],
                       torch.from_numpy(written["blk.0.ffn_norm.weight"]))
    # against the model the file was made from: every tensor, q and k with llama.cpp's permutation undone
    want = source.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           torch.from_numpy(written["blk.0.attn_q.weight"]))  # the permutation did matter
    # against what transformers itself loads from the GGUF
    direct = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32).eval()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(got[name], tensor), name
    # the same function: rotary base and norm epsilon came across (the logits depend on both)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 120, 64]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, source(ids).logits, atol=1e-5)

    converted = AutoTokenizer.from_pretrained(str(folder))
    assert len(converted) == len(tokenizer) == config.vocab_size  # no token without an embedding row
    text = "What is 3 + 4? The answer is 7.\nHello, how are you today?"
    ids = converted(text, add_special_tokens=False)["input_ids"]
    assert converted.decode(ids) == text and len(ids) < len(text)  # merges were applied
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # as the vocabulary's own tokenizer
    assert converted.eos_token == "<|im_end|>" and converted.chat_template == CHAT_TEMPLATE
    chat = converted.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)  # the control tokens stay whole
    assert converted(chat, add_special_tokens=False)["input_ids"] == \
        tokenizer(chat, add_special_tokens=False)["input_ids"]


def test_converting_the_alias_leaves_the_seeded_random_stream_alone(tmp_path, monkeypatch):
    """The first run on a machine converts the embedded model after the run has seeded torch: the conversion must
    not draw from torch's generator, or that run's adapter would start from other random numbers than every later
    run with the same seed (found comparing a first and a second demo run: LoRA A 0.08 apart)."""
    from rlora.models import embedded

    def convert_drawing_numbers(gguf_path, folder):  # building a model initialises its weights at random
        torch.randn(1000)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")

    monkeypatch.setenv("RLORA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "convert_gguf_to_hf", convert_drawing_numbers)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    folder = embedded.resolve_alias(embedded.SMOLLM2_ALIAS)  # converts: the cache is empty
    assert (tmp_path / "cache") in Path(folder).parents
    assert torch.equal(torch.rand(3), expected)
