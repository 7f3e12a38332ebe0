"""Imports every command module so each registers on the app."""

from rankkit.cli import (
    capture_cmd,  # noqa: F401
    compare_cmd,  # noqa: F401
    dashboard_cmd,  # noqa: F401
    data_cmd,  # noqa: F401
    diffusion_cmd,  # noqa: F401
    models_cmd,  # noqa: F401
    overhead_cmd,  # noqa: F401
    prefill_cmd,  # noqa: F401
    report_cmd,  # noqa: F401
    run_cmd,  # noqa: F401
    select_cmd,  # noqa: F401
    store_cmd,  # noqa: F401
    sweep_cmd,  # noqa: F401
)
