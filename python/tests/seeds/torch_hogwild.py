# The torch doc's Hogwild pattern (torch_multiprocessing.rst, "Hogwild"): a model in shared
# memory trained by several processes at once. Only the import changed; a tiny linear model on
# synthetic data. Usage: torch_hogwild.py fork|spawn
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import forksafe.multiprocessing as mp

TRUE_W = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
TRUE_B = 0.25


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


def train(model, seed):
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for _ in range(300):
        x = torch.randn(16, 4)
        y = x @ TRUE_W.t() + TRUE_B
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


if __name__ == '__main__':
    mp.set_start_method(sys.argv[1])
    torch.manual_seed(0)
    num_processes = 4
    model = Model()
    # NOTE: this is required for the ``fork`` method to work
    model.share_memory()
    processes = []
    for rank in range(num_processes):
        p = mp.Process(target=train, args=(model, rank))
        p.start()
        processes.append(p)
    for p in processes:
        p.join(120)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    # The parent never trained: its model learned only through the shared parameters.
    err = (model.fc.weight.data - TRUE_W).abs().max().item()
    berr = abs(model.fc.bias.data.item() - TRUE_B)
    print(f"weight error {err:.4f}, bias error {berr:.4f}")
    assert err < 0.05 and berr < 0.05, (model.fc.weight.data, model.fc.bias.data)
    print("SEED OK")
