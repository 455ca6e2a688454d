"""`slidedp validate`: measured step times beside the analytic and simulated predictions.

A validated case is data (conventions.md): `validation/<case>/` holds
    case.toml                the specs and the full plan (a one-case cases file)
    measured.json            step time, per-channel busy seconds, GPU peak, host PSS, date,
                             machine, GPU, torch version, the command, notes
    predicted.json           the analytic and simulated predictions, the hardware file, its sha256
    measured_trace.json.gz   the last measured step's Timeline (Chrome trace, gzip), when one was
                             saved (an older store's plain measured_trace.json is read as well)
    simulated_trace.json.gz  the simulated steady step (Chrome trace, gzip), beside a measured one
    overlay.png              both timelines per channel (plot.py), when both traces exist
(`validation/.runs/run<K>/<case>/`: a run's folders until it completes, measure.py) and
`validation/SUMMARY.md` / `summary.csv` put every stored case side by side with the error
statistics. Hardware numbers come from `slidedp profile` (or a preset) only: nothing is fitted to
end-to-end step times.

    cases.py     the cases file (TOML) and case.toml
    store.py     the folder layout, JSON files, hardware references
    runner.py    one rank process's measurement (torch): random host state, steps, merged Timeline
    worker.py    the rank-process entry point (python -m slidedp.validate.worker)
    measure.py   groups cases, runs them in-process (1 GPU) or through torchrun (R GPUs)
    predict.py   analytic + simulated predictions of a case
    summary.py   the side-by-side table, MAPE and maximum error
    importer.py  earlier benchmark results turned into stored cases
    traces.py    Timelines in and out of Chrome trace files (.json.gz or .json), the steady step
    plot.py      measured and simulated timelines overlaid per channel
    exposure.py  C, H, E per case and what-if re-simulations (the exposure notebook)
"""
