# Sourced by the GPU scripts (from the repository root): install the peers' wheels carried in .whl/.
# Liger (and its small dependencies) go to /tmp/site, on PYTHONPATH; TransformerEngine's wheel in
# .whl/te/ goes apart to /tmp/te_site (its package on the path breaks Liger's import through peft):
# benchmarks/bench_cross_entropy.py loads its Triton cross entropy from LOWP_BENCH_TE_SITE.
if compgen -G ".whl/*.whl" > /dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "warning: installing .whl/*.whl into /tmp/site failed"
    fi
fi
if compgen -G ".whl/te/*.whl" > /dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te_site .whl/te/*.whl; then
        export LOWP_BENCH_TE_SITE=/tmp/te_site
    else
        echo "warning: installing .whl/te/*.whl into /tmp/te_site failed"
    fi
fi
