// Sortable tables: a click on a header sorts by that column (again: the other way).
(function () {
  "use strict";
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (th, col) {
      th.addEventListener("click", function () {
        var body = table.tBodies[0];
        var numeric = th.getAttribute("data-type") === "number";
        var dir = th.getAttribute("data-dir") === "asc" ? -1 : 1;
        th.setAttribute("data-dir", dir === 1 ? "asc" : "desc");
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = a.cells[col].textContent.trim(), y = b.cells[col].textContent.trim();
          if (numeric) {
            var nx = x === "" ? Infinity : parseFloat(x), ny = y === "" ? Infinity : parseFloat(y);
            return (nx - ny) * dir;
          }
          return x.localeCompare(y) * dir;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
