"""`slidedp profile`: microbenchmarks of the machine at hand that write a hardware TOML.

    machine.py   what the machine is (host name, CPU, cores, RAM, LLC, GPUs) and the source line
    sizes.py     how much each measurement moves and how often it repeats (full, quick)
    timing.py    warm-up, synchronize, repeat, median: the one timing rule (the host rates:
                 rounds on fresh buffers, their harmonic mean)
    host.py      host DRAM copy, FP32 -> BF16 cast and CPU AdamW rates against thread count;
                 the cast by chunk size into a (pinned) staging ring
    pcie.py      H2D / D2H by chunk size, alone, duplex and with all GPUs at once (CUDA)
    compute.py   one decoder layer's fwd + bwd by (seq, micro-batch, policy), short runs and a
                 sustained back-to-back run; a bf16 matmul (CUDA)
    fabric.py    GPU topology, P2P link rate, NCCL collectives by message size (>= 2 GPUs)
    run.py       the measurement list, run under a progress bar
    assemble.py  results + a base preset -> the hardware TOML document, every number with a source
    tomlw.py     a small TOML writer for that document
    summary.py   the table printed at the end
"""
