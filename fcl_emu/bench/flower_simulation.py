"""Flower's side of ``fcl-emu bench flower`` (:mod:`fcl_emu.bench.flower`), run in Flower's environment
(:mod:`fcl_emu.bench.flower_env`): the FedAvg workload on Flower's simulation engine, its final test accuracy
written as JSON. The workload's constants live here, and the product's side takes them from here: this module
imports nothing of the product's at its top, so that Flower's side loads only what it uses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fcl_emu.bench.flower_env import ADD_PRODUCT_SITE

LR, BATCH, SEED = 0.05, 32, 0


def simulate(clients: int, cohort: int, rounds: int, epochs: int, data_root: list[Path]) -> float:
    """Flower's simulation of the workload; returns the final test accuracy (percent)."""
    import numpy as np
    import torch
    from flwr.client import NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation

    from fcl_emu.methods.models.classifier import build_model
    from fcl_emu.scenario.datasets import load_dataset
    from fcl_emu.scenario.scenario import build_scenario
    from fcl_emu.scenario.spec import ScenarioSpec
    from fcl_emu.scenario.transforms import to_tensor

    torch.set_num_threads(1)
    dataset = load_dataset("mnist", data_root)
    scenario = build_scenario(ScenarioSpec(dataset="mnist", num_tasks=1, num_clients=clients, seed=SEED), dataset)
    test_x = to_tensor(dataset.test_x, dataset.mean, dataset.std)
    test_y = torch.as_tensor(dataset.test_y, dtype=torch.long)

    def model_with(parameters) -> torch.nn.Module:
        model = build_model("cnn", dataset.input_shape, dataset.num_classes)
        if parameters is not None:
            state = dict(zip(model.state_dict().keys(), (torch.as_tensor(np.asarray(p)) for p in parameters)))
            model.load_state_dict(state)
        return model

    def parameters_of(model: torch.nn.Module) -> list:
        return [v.detach().cpu().numpy() for v in model.state_dict().values()]

    class Client(NumPyClient):
        def __init__(self, cid: int):
            indices = scenario.client_indices(cid, 0)
            self.x = to_tensor(dataset.train_x[indices], dataset.mean, dataset.std)
            self.y = torch.as_tensor(dataset.train_y[indices], dtype=torch.long)

        def fit(self, parameters, config):
            model = model_with(parameters)
            model.train()
            optimiser = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
            generator = torch.Generator().manual_seed(SEED)
            for _ in range(epochs):
                for batch in torch.randperm(len(self.x), generator=generator).split(BATCH):
                    optimiser.zero_grad()
                    torch.nn.functional.cross_entropy(model(self.x[batch]), self.y[batch]).backward()
                    optimiser.step()
            return parameters_of(model), len(self.x), {}

    def client_fn(cid: str):
        return Client(int(cid)).to_client()

    accuracy = {"last": 0.0}

    def evaluate(server_round, parameters, config):
        model = model_with(parameters).eval()
        with torch.no_grad():
            correct = sum(int((model(test_x[i:i + 1000]).argmax(1) == test_y[i:i + 1000]).sum())
                          for i in range(0, len(test_x), 1000))
        accuracy["last"] = 100.0 * correct / len(test_x)
        return 0.0, {"accuracy": accuracy["last"]}

    def add_product_site() -> None:  # Ray's workers start as bare Pythons of Flower's environment
        exec(ADD_PRODUCT_SITE, {})

    torch.manual_seed(SEED)
    strategy = FedAvg(fraction_fit=cohort / clients, min_fit_clients=cohort, min_available_clients=clients,
                      fraction_evaluate=0.0, min_evaluate_clients=0, evaluate_fn=evaluate,
                      initial_parameters=ndarrays_to_parameters(parameters_of(model_with(None))))
    start_simulation(client_fn=client_fn, num_clients=clients, config=ServerConfig(num_rounds=rounds),
                     strategy=strategy, client_resources={"num_cpus": 1},
                     ray_init_args={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
                                    "runtime_env": {"worker_process_setup_hook": add_product_site}})
    return accuracy["last"]


def main() -> None:
    parser = argparse.ArgumentParser(description="The Flower side of `fcl-emu bench flower`.")
    for name in ("clients", "cohort", "rounds", "epochs"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--data-root", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    accuracy = simulate(args.clients, args.cohort, args.rounds, args.epochs, args.data_root)
    args.out.write_text(json.dumps({"accuracy": accuracy}))


if __name__ == "__main__":
    main()
