"""Programs nobody here wrote, run as their authors run them: Hugging Face `transformers`
models built from small configs, torchvision's models and PyTorch's own examples (MNIST,
word language model, DCGAN), on synthetic data.

Each program takes a device and returns plain numbers (losses, generated tokens, a checksum
of the trained weights), so a local run and a run on gpupool remote GPUs compare with `==`.
The models are built on the host from a fixed seed (as `from_config` and torchvision's
constructors do) and moved to the device, so both runs start from the same weights; the
seed is set again before training, so dropout and sampling draw alike where a program uses
them. tests/torch/test_real_programs.py runs them on CPU workers; bench/real_programs.py
on the GPU machine, local CUDA against a CUDA worker.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Result = dict[str, Any]


def _checksum(model: nn.Module) -> float:
    """One number that moves with every trained weight."""
    with torch.no_grad():
        total = sum(p.detach().double().abs().sum().cpu() for p in model.parameters())
    return float(total)


def _tokens(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _images(n: int, channels: int, size: int, classes: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, size, size, generator=g)
    return x, torch.randint(0, classes, (n,), generator=g)


# ---- optional packages ------------------------------------------------------------------------


def transformers_module() -> Any:
    """`transformers`, or None where it is not installed (the tests skip, saying so).
    Its image models import torchvision where it is installed: see torchvision_module()."""
    torchvision_module()
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None


_TORCHVISION_FAKE_OPS: Any = None


def torchvision_module() -> Any:
    """`torchvision`, or None where it is not installed.

    PyPI's torchvision wheels are CUDA builds: their C extension links libtorch_cuda, so with
    a CPU-only torch it does not load and torchvision's own ops (nms, roi_align, image
    decoding) are absent. The models are Python and need none of them, but torchvision 0.28
    registers fake kernels for `torchvision::nms` and `qnms` without checking that the
    extension loaded, and its import fails. Declaring those two schemas (no kernel behind
    them: a call still fails, naming the op) lets the import through."""
    global _TORCHVISION_FAKE_OPS
    try:
        return importlib.import_module("torchvision")
    except ImportError:
        return None
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or _TORCHVISION_FAKE_OPS is not None:
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_FAKE_OPS = library
    return importlib.import_module("torchvision")


# ---- Hugging Face transformers ------------------------------------------------------------------

_NO_DROPOUT = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _hf_training(model: Any, device: str, batches: list[dict[str, Any]], lr: float) -> Result:
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    torch.manual_seed(5)
    for batch in batches:
        out = model(**{k: v.to(device) for k, v in batch.items()})
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
    return {"losses": losses, "checksum": _checksum(model)}


def _greedy(model: Any, device: str, prompt: torch.Tensor, new_tokens: int, **extra: Any) -> Any:
    model.eval()
    with torch.no_grad():
        out = model.generate(
            prompt.to(device),
            attention_mask=torch.ones_like(prompt).to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            **extra,
        )
    return out.cpu().tolist()


def gpt2(device: str) -> Result:
    """GPT-2 (LM head, tied embeddings): AdamW steps with clipping, then greedy generation."""
    tf = transformers_module()
    config = tf.GPT2Config(
        vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, **_NO_DROPOUT
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    ids = [_tokens(2, 16, 96, seed) for seed in range(3)]
    result = _hf_training(model, device, [{"input_ids": x, "labels": x} for x in ids], 1e-3)
    result["tokens"] = _greedy(model, device, ids[0][:, :5], 8, pad_token_id=0)
    return result


def bert(device: str) -> Result:
    """BERT for sequence classification with a padding mask, then masked-LM inference."""
    tf = transformers_module()
    config = tf.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(config)
    batches = []
    for seed in range(3):
        ids = _tokens(4, 12, 96, seed)
        mask = torch.ones_like(ids)
        mask[:, 9:] = 0  # padded tails, as a tokenizer's batch has
        labels = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(seed + 10))
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    result = _hf_training(model, device, batches, 1e-3)
    torch.manual_seed(0)
    masked_lm = tf.BertForMaskedLM(config).to(device).eval()
    ids = _tokens(2, 10, 96, 7)
    with torch.no_grad():
        logits = masked_lm(input_ids=ids.to(device)).logits
    result["predicted"] = logits.argmax(-1).cpu().tolist()
    return result


def t5(device: str) -> Result:
    """T5 (encoder-decoder, relative attention bias): training with labels, then generation."""
    tf = transformers_module()
    config = tf.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(config)
    batches = [
        {"input_ids": _tokens(2, 10, 96, seed), "labels": _tokens(2, 6, 96, seed + 20)}
        for seed in range(3)
    ]
    result = _hf_training(model, device, batches, 1e-3)
    result["tokens"] = _greedy(model, device, batches[0]["input_ids"], 6)
    return result


def vit(device: str) -> Result:
    """ViT image classification (patch embedding, CLS token, GELU MLP)."""
    tf = transformers_module()
    config = tf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(config)
    batches = []
    for seed in range(3):
        x, y = _images(4, 3, 16, 5, seed)
        batches.append({"pixel_values": x, "labels": y})
    return _hf_training(model, device, batches, 1e-3)


def llama(device: str) -> Result:
    """A Llama-shaped model (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU):
    training, then greedy generation with its key-value cache."""
    tf = transformers_module()
    config = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    ids = [_tokens(2, 16, 96, seed) for seed in range(3)]
    result = _hf_training(model, device, [{"input_ids": x, "labels": x} for x in ids], 1e-3)
    result["tokens"] = _greedy(model, device, ids[1][:, :6], 8)
    return result


# ---- torchvision ----------------------------------------------------------------------------


def _vision_training(model: nn.Module, device: str, size: int, steps: int = 3) -> Result:
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    losses = []
    torch.manual_seed(5)
    for seed in range(steps):
        x, y = _images(4, 3, size, 10, seed)
        loss = F.cross_entropy(model(x.to(device)), y.to(device), label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        x, _ = _images(2, 3, size, 10, 99)
        predicted = model(x.to(device)).argmax(1).cpu().tolist()
    return {"losses": losses, "checksum": _checksum(model), "predicted": predicted}


def resnet18(device: str) -> Result:
    """torchvision's ResNet-18 (BatchNorm with running statistics, residual adds)."""
    torch.manual_seed(0)
    return _vision_training(torchvision_module().models.resnet18(num_classes=10), device, 32)


def mobilenet_v3(device: str) -> Result:
    """torchvision's MobileNetV3-small (depthwise convolutions, hardswish, squeeze-excite);
    its classifier's dropout is on while training."""
    torch.manual_seed(0)
    model = torchvision_module().models.mobilenet_v3_small(num_classes=10)
    return _vision_training(model, device, 32)


def vision_transformer(device: str) -> Result:
    """torchvision's VisionTransformer (nn.MultiheadAttention, class token, conv stem)."""
    torch.manual_seed(0)
    model = torchvision_module().models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    )  # fmt: skip
    return _vision_training(model, device, 32)


# ---- PyTorch's examples -----------------------------------------------------------------------


class MnistNet(nn.Module):
    """pytorch/examples mnist/main.py's Net, as written there."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def mnist(device: str, num_workers: int = 2) -> Result:
    """mnist/main.py's loop: a DataLoader with workers and pinned memory, Adadelta with StepLR,
    nll_loss, then the test pass with `sum` reduction and the accuracy count."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(24, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (24,), generator=g)
    dataset = torch.utils.data.TensorDataset(images, labels)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=num_workers, pin_memory=True,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    torch.manual_seed(0)
    model = MnistNet().to(device)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    losses = []
    torch.manual_seed(5)
    for _epoch in range(2):
        model.train()
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            opt.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        scheduler.step()
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in torch.utils.data.DataLoader(dataset, batch_size=12):
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    return {"losses": losses, "test_loss": test_loss, "correct": correct}


class RNNModel(nn.Module):
    """word_language_model/model.py's RNNModel (LSTM, tied weights), as written there."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # tie_weights
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def _repackage_hidden(h: Any) -> Any:
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(_repackage_hidden(v) for v in h)


def word_language_model(device: str) -> Result:
    """word_language_model/main.py's train(): batchify, truncated backprop through time with
    repackaged hidden state, gradient clipping and the hand-written SGD update."""
    ntokens, bptt, lr = 50, 6, 20.0
    corpus = torch.randint(0, ntokens, (200,), generator=torch.Generator().manual_seed(1))
    bsz = 4
    nbatch = corpus.size(0) // bsz
    data = corpus.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous().to(device)
    torch.manual_seed(0)
    model = RNNModel(ntokens, 16, 16, 2, dropout=0.2).to(device)
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(bsz)
    losses = []
    torch.manual_seed(5)
    for i in range(0, 4 * bptt, bptt):
        seq_len = min(bptt, len(data) - 1 - i)
        source, targets = data[i : i + seq_len], data[i + 1 : i + 1 + seq_len].reshape(-1)
        model.zero_grad()
        hidden = _repackage_hidden(hidden)
        output, hidden = model(source, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return {"losses": losses, "checksum": _checksum(model)}


class DcganGenerator(nn.Module):
    """dcgan/main.py's Generator, as written there (64x64 images)."""

    def __init__(self, nz: int, ngf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class DcganDiscriminator(nn.Module):
    """dcgan/main.py's Discriminator, as written there."""

    def __init__(self, ndf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


def _dcgan_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


def dcgan(device: str) -> Result:
    """dcgan/main.py's loop: the discriminator on real and on detached fake images, then the
    generator through the discriminator; BCELoss, two Adam optimizers, noise drawn on the
    device."""
    nz, ngf, ndf, nc, batch = 8, 4, 4, 3, 4
    torch.manual_seed(0)
    net_g = DcganGenerator(nz, ngf, nc)
    net_g.apply(_dcgan_init)
    net_d = DcganDiscriminator(ndf, nc)
    net_d.apply(_dcgan_init)
    net_g.to(device)
    net_d.to(device)
    criterion = nn.BCELoss()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real_images = torch.randn(batch * 2, nc, 64, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    losses = []
    for i in range(2):
        real = real_images[i * batch : (i + 1) * batch].to(device)
        net_d.zero_grad()
        label = torch.full((batch,), 1.0, dtype=real.dtype, device=device)
        err_d_real = criterion(net_d(real), label)
        err_d_real.backward()
        noise = torch.randn(batch, nz, 1, 1, device=device)
        fake = net_g(noise)
        label.fill_(0.0)
        err_d_fake = criterion(net_d(fake.detach()), label)
        err_d_fake.backward()
        opt_d.step()
        net_g.zero_grad()
        label.fill_(1.0)
        err_g = criterion(net_d(fake), label)
        err_g.backward()
        opt_g.step()
        losses.append([(err_d_real + err_d_fake).item(), err_g.item()])
    return {"losses": losses, "checksum": _checksum(net_g) + _checksum(net_d)}


Program = Callable[[str], Result]

PROGRAMS: dict[str, tuple[str, Program]] = {
    "gpt2": ("transformers", gpt2),
    "bert": ("transformers", bert),
    "t5": ("transformers", t5),
    "vit": ("transformers", vit),
    "llama": ("transformers", llama),
    "resnet18": ("torchvision", resnet18),
    "mobilenet_v3": ("torchvision", mobilenet_v3),
    "vision_transformer": ("torchvision", vision_transformer),
    "mnist": ("", mnist),
    "word_language_model": ("", word_language_model),
    "dcgan": ("", dcgan),
}
"""name: (the package it needs, the program)."""


def available(package: str) -> bool:
    if package == "transformers":
        return transformers_module() is not None
    if package == "torchvision":
        return torchvision_module() is not None
    return True
