"""Sphinx configuration of the course book.

Not run on this folder directly: `scripts/build_book.py` (`make book`) copies this folder and the
chapter notebooks into one source folder, adds the generated course map and roadmap figure
(`_generated/`), and runs Sphinx there.
"""

project = "paged-kv-course"
author = "the paged-kv-course authors"
language = "en"

extensions = ["myst_nb"]

# The book shows the outputs stored in the notebooks (figures, tables, printed text, widget
# state); nothing is executed, so building needs no kernel, no torch and no GPU.
nb_execution_mode = "off"
nb_merge_streams = True

myst_enable_extensions = ["colon_fence"]

# _generated/ holds pieces that index.md includes; they are not pages of their own.
exclude_patterns = ["_generated", "_static", "**.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_title = "paged-kv-course"
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": True,  # each chapter's .ipynb, with its outputs
    "use_fullscreen_button": False,
}
html_last_updated_fmt = None
# wider pages, and the static snapshots of the ipywidgets explorers (snapshots.py)
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_js_files = ["widget_snapshots.js"]
