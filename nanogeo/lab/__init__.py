"""lab: studies, benchmarks and measurement tools (not needed to train): the convergence study
driver, the step-time model, gradient capture and fidelity, profiling."""
