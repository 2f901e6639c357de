// Every ipywidgets explorer in the book has a static snapshot after it (docs/book/snapshots.py).
// When the widgets' JavaScript has loaded from its CDN and drawn the live view, hide the snapshot;
// offline the live view stays empty and the snapshot stays.
window.addEventListener("load", () => {
  let tries = 0;
  const timer = setInterval(() => {
    document.querySelectorAll(".widget-snapshot").forEach((snapshot) => {
      const output = snapshot.closest(".cell_output");
      if (output && output.querySelector(".jupyter-widgets, .widget-subarea")) {
        snapshot.hidden = true;
      }
    });
    tries += 1;
    if (tries >= 20) clearInterval(timer);
  }, 500);
});
