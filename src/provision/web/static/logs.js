// The job's logs, followed: 0.3 s after each answer, the lines after the last cursor. Each line
// is added as text (textContent), never as HTML: a log line is data from a host.
(function () {
  "use strict";
  var box = document.getElementById("log");
  if (!box) { return; }
  var errors = document.getElementById("log-errors");
  var url = box.getAttribute("data-url");
  var after = "";
  var polls = 0;
  function poll() {
    fetch(url + (after ? "?after=" + encodeURIComponent(after) : ""), {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (doc) {
        var atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
        doc.lines.forEach(function (l) {
          var line = document.createElement("div");
          line.className = "line";
          line.textContent = l.task + "@" + l.host + " | " + l.text;
          box.appendChild(line);
        });
        if (atEnd) { box.scrollTop = box.scrollHeight; }
        after = doc.after || after;
        if (doc.kept) { var kept = document.getElementById("log-kept"); if (kept) { kept.hidden = false; } }
        errors.textContent = (doc.errors || []).join("; ");
        polls += 1;
        box.setAttribute("data-polls", String(polls));  // a test knows the page has caught up
      })
      .catch(function (e) { errors.textContent = "logs: " + e; })
      .then(function () { setTimeout(poll, after.indexOf("kept") === 0 ? 5000 : 300); });  // one at a time; a kept copy changes no more
  }
  poll();
})();
