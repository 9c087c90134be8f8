"""Your own Hugging Face model: a small GPT2LMHeadModel on the standard library's source text.

    python examples/bring_your_own/hf_gpt2.py                                   # one process
    horovodrun -np 2 python examples/bring_your_own/hf_gpt2.py --layout sharded:3
    srun -n 2 --mpi=pmix python examples/bring_your_own/hf_gpt2.py              # in a Slurm job

The model is built from its config (random weights: nothing is downloaded) and trained with
torch's AdamW and a OneCycleLR schedule (a sharded layout steps them over this rank's pieces).
Its forward returns a ``ModelOutput``; the toolkit's loss reads its ``logits`` (a tuple's first
element, a plain tensor as it is). GPT-2 ties its output head to its token embedding: the
sharded layouts keep the one parameter. A pipeline cuts an ``nn.Sequential``: under
``--layout pipeline:S:M`` the same modules are laid out as one (embeddings, blocks, final
norm, head), and the stages holding the embedding and the head keep the tie by summing its
gradients (docs/bring-your-own.md). Its checkpoints name the parameters by that Sequential's
positions.
"""

import torch
from torch import nn

import adapters
import toolkit
from toolkit.datasets import load_text


class Embeddings(nn.Module):
    """GPT-2's token and position embeddings (and their dropout) as one module: the first
    layer of the Sequential a pipeline cuts."""

    def __init__(self, transformer):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


def as_sequential(model) -> nn.Sequential:
    """The modules of a ``GPT2LMHeadModel`` in the order its forward runs them (each block
    returns its hidden states; without a mask its attention is causal)."""
    t = model.transformer
    return nn.Sequential(Embeddings(t), *t.h, t.ln_f, model.lm_head)  # lm_head.weight is wte's


def main() -> None:
    parser = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    toolkit.add_trainer_options(parser, skip=("epochs",), steps=200, batch_size=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="OneCycleLR's peak")
    parser.add_argument("--context", type=int, default=64, help="bytes per sample")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's own: 0.1")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel  # (its import takes seconds)

    corpus = load_text()
    train = toolkit.TokenWindows(corpus.train, args.context)
    val = toolkit.TokenWindows(corpus.val[:64 * args.context + 1], args.context)
    torch.manual_seed(args.seed)  # rank 0's initial weights are broadcast to every rank anyway
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
        attn_pdrop=args.dropout, use_cache=False, bos_token_id=0, eos_token_id=0))

    if args.layout.startswith("pipeline"):
        model = as_sequential(model)
    # (a sharded layout rebinds its groups to this rank's pieces: the scheduler stays bound)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    trainer = toolkit.Trainer(adapters.get("horovod-torch"), model, (opt, schedule),
                              **toolkit.trainer_options(args))
    history = trainer.fit(train, validation=val)
    final = history.evaluations[-1]  # (fit evaluates the model it returns)
    toolkit.print0(f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
                   f"val_loss {final['val_loss']:.4f}  val_accuracy {final['val_accuracy']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
