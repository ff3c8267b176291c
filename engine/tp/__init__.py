"""The model's tensor-parallel maths: a rank's place in its group and which parameters it splits.

- `tensor_parallel`: a rank's place in the group and its one collective;
- `sharding`: which parameter is split along which dimension.
"""
