"""The helpers every stage uses: the config, the run folder and its manifests, the target and the embedded
targets, prompt sources, hidden-state shards, the drafters, device and dtype rules, atomic writes, errors, processes,
logging, plots. A stage imports these and what earlier stages wrote; what two stages share lives here."""
