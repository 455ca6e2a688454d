"""The byte and rate units the specs convert to and from: decimal GB for rates (GB/s, as the
hardware's data sheets and the profile give them), binary GiB and MiB for sizes."""

GB = 1e9
GIB = 2**30
MIB = 2**20
