"""``kvtier doctor``: audit a serve command line before it runs, and measure this machine.

:mod:`~kvtier.doctor.setup` resolves what a line configures, :mod:`~kvtier.doctor.checks` and
:mod:`~kvtier.doctor.model_checks` turn it into findings (:mod:`~kvtier.doctor.audit` runs them
all), :mod:`~kvtier.doctor.probes` are the side-effect-free looks at the filesystem and the
checkpoint, :mod:`~kvtier.doctor.measure` the bandwidth measurements. Operator side: runs in the
``kvtier`` command's process, never inside an engine; never imports vLLM.
"""
