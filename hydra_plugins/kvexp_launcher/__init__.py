"""kvexp's Hydra launcher plugin (found by Hydra in the hydra_plugins namespace package): `hydra/launcher=kvexp_slurm`."""
