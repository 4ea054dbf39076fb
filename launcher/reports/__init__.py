"""Reports a person can look at: one self-contained HTML page per run (:mod:`.run`) and per
sweep (:mod:`.sweep`), read back from the run directories (:mod:`.data`). The plan's own report
is :mod:`launcher.plan.html_report`; the pages are built with :mod:`launcher.html`.
"""
