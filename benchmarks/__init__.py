"""asv benchmarks: distbench's training and collective metrics over the commit history.

How to run (see bench_training.py for what is measured):

    asv machine --yes --machine h200x4   # once per machine; name it GPU model x count (cpu on a laptop)
    asv run --python=same --quick --set-commit-hash $(git rev-parse HEAD)   # this checkout, no new venv
    asv continuous main HEAD             # compare two commits (GPU image: VIRTUALENV_SYSTEM_SITE_PACKAGES=true)
    asv publish && asv preview           # HTML in .asv/html

`--python=same` benchmarks the installed (editable) checkout in the current interpreter; without
`--set-commit-hash` asv runs but records nothing. `asv continuous` has to install each commit, so
asv.conf.json uses virtualenv environments: a wheel of distbench alone (no build isolation), installed after
torch (the pinned CPU wheel, unless the environment already sees a torch) and with its dependencies, so
DeepSpeed builds against that torch; then the commit's wheel again with --force-reinstall, which wins over a
distbench the machine itself has installed. VIRTUALENV_SYSTEM_SITE_PACKAGES=true lets those environments see
the machine's torch, NCCL, DeepSpeed and transformers instead of downloading them (the GPU image has no
internet); on a CPU machine without it they install their own.
"""
