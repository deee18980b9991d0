// Live updates: the page's event stream (body data-events) sends fragments of HTML,
// rendered and escaped by the server, keyed by the id of the element they replace.
// EventSource reconnects by itself; the dot in the header says whether it is live.
(function () {
  "use strict";
  var url = document.body.getAttribute("data-events");
  var dot = document.getElementById("live");
  if (!url || !window.EventSource) {
    return;
  }
  var source = new EventSource(url);
  source.addEventListener("open", function () {
    if (dot) { dot.className = "live on"; }
  });
  source.addEventListener("error", function () {
    if (dot) { dot.className = "live"; }
  });
  source.addEventListener("update", function (event) {
    var fragments = JSON.parse(event.data);
    Object.keys(fragments).forEach(function (id) {
      var element = document.getElementById(id);
      if (element) {
        element.innerHTML = fragments[id];
      }
    });
    document.body.setAttribute("data-updates",
      String(Number(document.body.getAttribute("data-updates") || "0") + 1));
  });
})();
