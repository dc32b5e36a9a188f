"""ParM coded resilience (Kosaian et al., SOSP'19), in one package.

- `spec.py`: a model's parity model, its spec and key (pure).
- `codes.py`: the parity codes (encode, decode), one implementation for training and serving.
- `groups.py`: coding groups as controller state: the state machine, driven by `now`.
- `planner.py`: ParM's workflow in the controller: parity batches, replicas, reconstructions.
- `trainer.py`: `escapement train-parity`'s recipe, training a parity model for a deployed one.
- `lifted.py`: the deployed program as a trainable module, and the trained weights back into a program.
- `datasets.py`: what the trainer trains on: the digits the demo models use (its default), or an npz file.
- `zoo.py`: architectures the trainer was not tuned on (tests and the parity benchmark).

docs/parity.md walks through it.
"""
